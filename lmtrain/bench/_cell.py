"""One benchmark cell in a fresh interpreter: ``python -m lmtrain.bench._cell CELL_JSON LOGDIR RESULT_PATH``.

The ``spawn`` launcher of ``lmtrain.bench.model`` runs this; the result (or the failure) is written as JSON
to ``RESULT_PATH``. An empty ``LOGDIR`` means no TensorBoard logs.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str] | None = None) -> int:
    from lmtrain.bench.model import Cell, run_cell_to_file

    cell_json, logdir, result_path = sys.argv[1:4] if argv is None else argv
    run_cell_to_file(Cell(**json.loads(cell_json)), logdir or None, result_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
