"""Former name of ``lmtrain.bench.model`` (the ``bench model`` command): importing it gives that module itself, so
``lmtrain.bench.sweep.X`` and ``lmtrain.bench.model.X`` are one object."""

import sys

from lmtrain.bench import model

sys.modules[__name__] = model
