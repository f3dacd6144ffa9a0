"""DtypeRecorder: forward hooks that record the dtypes each module of a model sees and returns (capture only).

Used by ``PrecisionInspector`` for its inspected step and by ``python -m lmtrain bench precision``; what the
records mean is worked out in ``lmtrain.analysis.dtypes``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn as nn

from lmtrain.analysis.dtypes import ModuleCall, first_float_tensor, module_entries, tensors


class DtypeRecorder:
    """Forward hooks on every submodule of ``root`` that record input and output dtypes (and the autocast state).

    Use as a context manager (hooks removed on exit; the block runs with the compiler's stance ``force_eager``)
    or call :meth:`install` / :meth:`remove`. Compiled code skips module hooks added after its first call (dynamo
    does not guard on them), so on a compiled model that has run before the recorded step must run eagerly:
    the context manager does that, and :meth:`install`'s caller must (``torch.compiler.set_stance``). The outputs
    and inputs of the outermost modules (depth <= 1) are kept by reference for the logits and the fp32
    reference forward; :meth:`remove` drops them.

    Args:
        root: the module whose submodules are hooked (the root itself too, as path ``""``).
        device_type: ``cuda`` or ``cpu``: whose autocast state to read.
    """

    def __init__(self, root: nn.Module, device_type: str) -> None:
        self.root = root
        self.device_type = device_type
        self.calls: dict[str, ModuleCall] = {}
        self.order: list[str] = []
        self.kept: dict[str, tuple[tuple, dict, Any]] = {}  # path -> (args, kwargs, output), depth <= 1
        # parameter path -> its dtype while its module ran (under FSDP2: the all-gathered compute dtype)
        self.param_compute: dict[str, torch.dtype] = {}
        self.paused = False
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._stance: contextlib.ExitStack | None = None

    def install(self) -> None:
        for path, module in self.root.named_modules():
            if path == "" and callable(getattr(module, "training_step", None)):
                # A LightningModule: under DDP its training_step runs as the root's forward (Lightning redirects
                # the wrapped module's forward); that call is the step, not the model's forward pass.
                continue
            self._handles.append(module.register_forward_hook(self._hook(path), with_kwargs=True))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.kept.clear()

    @property
    def installed(self) -> int:
        return len(self._handles)

    def __enter__(self) -> DtypeRecorder:
        self._stance = contextlib.ExitStack()
        self._stance.enter_context(torch.compiler.set_stance("force_eager"))
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
        if self._stance is not None:
            self._stance.close()
            self._stance = None

    def _hook(self, path: str) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if self.paused:
                return
            call = self.calls.get(path)
            if call is None:
                call = self.calls[path] = ModuleCall(type=type(module).__name__, module_path=type(module).__module__)
                own = list(module.named_parameters(recurse=False))
                call.param_dtypes = sorted({p.dtype for _, p in own}, key=str)
                for name, p in own:
                    self.param_compute[f"{path}.{name}" if path else name] = p.dtype
                self.order.append(path)
            call.calls += 1
            for t in tensors((args, kwargs)):
                if t.dtype not in call.in_dtypes:
                    call.in_dtypes.append(t.dtype)
            for t in tensors(output):
                if t.dtype not in call.out_dtypes:
                    call.out_dtypes.append(t.dtype)
            call.autocast = torch.is_autocast_enabled(self.device_type)
            call.autocast_dtype = torch.get_autocast_dtype(self.device_type) if call.autocast else None
            if path.count(".") + (path != "") <= 1:
                self.kept[path] = (args, kwargs, output)

        return hook

    def logits_path(self, preferred: str | None = None) -> str | None:
        """The module whose output is the logits: ``preferred`` if given, else the outermost module that ran
        and returned a floating tensor (first in call order among equals)."""
        if preferred is not None:
            return preferred if preferred in self.calls else None
        ran = [p for p in self.order if p in self.kept and first_float_tensor(self.kept[p][2]) is not None]
        if not ran:
            return None
        return min(ran, key=lambda p: (p.count(".") + (p != ""), self.order.index(p)))

    def autocast_state(self) -> tuple[bool, torch.dtype | None]:
        """(autocast on, its dtype) as seen by the modules (on if any module ran under autocast)."""
        for path in self.order:
            if self.calls[path].autocast:
                return True, self.calls[path].autocast_dtype
        return False, None

    def module_entries(self, compute_dtype: torch.dtype) -> list[dict[str, Any]]:
        """One entry per module path, in call order (see ``lmtrain.analysis.dtypes.module_entries``)."""
        return module_entries(self.calls, self.order, compute_dtype)
