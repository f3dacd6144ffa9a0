"""NVTXRanges: named ranges for steps, phases, transformer blocks and attention stages (NVTX and profiler)."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torch.cuda import nvtx
from typing_extensions import override

from lmtrain.annotate import disable_ranges, enable_ranges, profiler_recording
from lmtrain.callbacks._common import StepPhases, StepWindow, WarnOnce, check_int
from lmtrain.errors import LmtrainError

Depth = Literal["step", "phase", "block", "module", "op"]
DEPTHS: tuple[str, ...] = ("step", "phase", "block", "module", "op")

#: Module-level ranges emitted by default: each block's attention and MLP.
DEFAULT_MODULE_PATTERNS: tuple[str, ...] = ("*.attn", "*.mlp")

#: Name of the constant parent range of every step, so NVTX filters can name it (``step/forward/``).
STEP_RANGE = "step"


def _nvtx_available() -> bool:
    """NVTX ranges need the CUDA runtime (its tools hook in there)."""
    return torch.cuda.is_available()


@dataclass
class _Open:
    """One range this callback opened: NVTX push/pop or start/end, and the profiler's record_function."""

    name: str
    nvtx_kind: str | None  # "push", "start" or None
    nvtx_id: Any
    record: torch.profiler.record_function | None


class NVTXRanges(pl.Callback):
    """Named ranges on the timeline: Nsight Systems / Nsight Compute (NVTX) and ``torch.profiler``.

    Ranges, nested in this order (``depth`` says how deep to go; each level includes the ones above):

    - ``step``: a constant-name range ``step`` around every training batch (so a filter such as
      ``ncu --nvtx --nvtx-include "step/forward/"`` can name it), and ``step/<index>`` (NVTX start/end
      range, outside the push/pop stack, so it does not get in the way of push/pop filters; a
      ``record_function`` range for the profiler). The index is the step's ``trainer.global_step`` (see
      ``lmtrain.callbacks._common.StepPhases``; the micro-batches of one step share it).
    - ``phase``: ``forward`` (batch start -> ``on_before_backward``, or the whole step without a
      backward), ``backward`` (``on_before_backward`` -> ``on_after_backward``), ``optimizer``
      (``on_before_optimizer_step`` -> batch end).
    - ``block``: ``blocks.<i>`` around each element of the model's ``nn.ModuleList`` (the repeated
      transformer blocks), named by its path below the module that holds the list.
    - ``module``: each block's ``attn`` and ``mlp`` (``blocks.<i>.attn``, ``blocks.<i>.mlp``).
    - ``op``: ranges placed in the code with ``lmtrain.annotate``, e.g. the naive attention stages
      ``attention/qk_matmul``, ``attention/softmax``, ``attention/pv_matmul``.

    Block and module ranges come from forward pre/post hooks (no edits to the model, no patching),
    installed when the window opens and removed when it closes, so steps outside the window run no
    hook at all. They cover forward passes, including the recomputation of checkpointed blocks during
    backward; the backward pass itself appears as the ``backward`` phase (module backward hooks would
    change autograd's behaviour and cost). Every range this callback opens is kept on a stack, and a
    step that raises closes them all (``on_exception``), so the timeline stays balanced.

    Without CUDA, NVTX is unavailable: only ``record_function`` ranges are emitted (one warning).
    This callback logs no metrics.

    Timing: the default (depth ``phase``, every step) leaves step times as they are, so ``CudaSyncTimer`` keeps
    those steps in its statistics. Depth ``block`` and deeper perturbs the window's steps (see
    :meth:`perturbs_timing`); give such a window a few steps (``start_step``, ``num_steps``) and the timer leaves
    them out of its summary.

    Args:
        depth: ``step``, ``phase`` (default), ``block``, ``module`` or ``op`` (see above).
        start_step: first step with ranges, on Lightning's ``global_step`` axis.
        num_steps: steps (optimizer steps) in the window; None: every step from ``start_step`` on.
        nvtx: emit NVTX ranges (for ``nsys`` / ``ncu``).
        record_function: emit ``torch.profiler.record_function`` ranges (for ``torch.profiler``), while a profiler
            records (``lmtrain.annotate.profiler_recording``: outside one such a range reaches no trace and costs
            an operator dispatch; on a CPU this made the callback's hooks 6x cheaper, 429 -> 73 µs per step).
        module_types: class names (e.g. ``["SwiGLU"]``) of further modules, anywhere in the model, that
            get a range named by their path (at depth ``module`` and deeper).
        module_names: ``fnmatch`` patterns over block and module range names (``blocks.3``,
            ``blocks.3.attn``) choosing which get ranges; None: every block, and ``*.attn`` / ``*.mlp``.
    """

    def __init__(
        self,
        depth: Depth = "phase",
        start_step: int = 0,
        num_steps: int | None = None,
        nvtx: bool = True,
        record_function: bool = True,
        module_types: list[str] | None = None,
        module_names: list[str] | None = None,
    ) -> None:
        super().__init__()
        self.depth = depth
        self.start_step = start_step
        self.num_steps = num_steps
        self.nvtx = nvtx
        self.record_function = record_function
        self.module_types = module_types
        self.module_names = module_names
        self._warn = WarnOnce()
        self._stack: list[_Open] = []
        self._handles: list[Any] = []
        self._annotate_on: tuple[bool, bool] | None = None
        self._use_nvtx = False
        self._window = StepWindow(start_step, num_steps)
        self._phases = StepPhases()
        self._in_window = False

    def in_window(self, step: int) -> bool:
        """Step ``step`` has this callback's ranges (and, at depth ``block`` and deeper, its module hooks)."""
        return self._window.contains(step)

    def perturbs_timing(self, step: int) -> bool:
        """Ranges at depth ``step`` and ``phase`` cost a few host microseconds per step and change no kernel:
        no. At depth ``block`` and deeper: yes inside the window. Two Python forward hooks per block and module run
        on every call (each an NVTX push/pop and a ``record_function`` dispatch), tens to hundreds per step,
        which a host-bound step pays in full; under CUDA graphs the window's steps also run eagerly."""
        return self._depth_at_least("block") and self._window.contains(step)

    def needs_eager_step(self, step: int) -> bool:
        """At depth ``block`` and deeper the ranges come from module hooks and dispatched operations, which a CUDA
        graph replay (``LMModule(cuda_graphs=True)``) does not run: the window's steps run eagerly."""
        return self._depth_at_least("block") and self._window.contains(step)

    # -- setup / teardown -----------------------------------------------------------------------

    def check_arguments(self, world_size: int = 1) -> None:
        """Check the arguments: ``setup`` calls it, and the command line before any log folder exists.

        Args:
            world_size: the number of processes of the run (unused here).

        Raises:
            LmtrainError: an argument is out of range, naming it.
        """
        if self.depth not in DEPTHS:
            raise LmtrainError("callbacks.NVTXRanges.depth", f"unknown depth {self.depth!r}.", f"use one of {DEPTHS}.")
        check_int("NVTXRanges", "start_step", self.start_step, 0)
        check_int("NVTXRanges", "num_steps", self.num_steps, 1, allow_none=True,
                  fix="use num_steps >= 1, or None for every batch from start_step on.")

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.check_arguments()
        self._use_nvtx = self.nvtx and _nvtx_available()
        if self.nvtx and not self._use_nvtx:
            self._warn("NVTXRanges: NVTX needs CUDA and none is available; emitting only record_function ranges.")
        if not self._use_nvtx and not self.record_function:
            self._warn("NVTXRanges: neither NVTX nor record_function ranges are enabled; nothing will be emitted.")
        self._window = StepWindow(self.start_step, self.num_steps)
        self._phases.reset()
        if getattr(pl_module, "cuda_graphs", False) and not self._depth_at_least("block"):
            rank_zero_info("NVTXRanges: a step replayed as a CUDA graph gets one range, 'cuda graph', instead of its "
                           "phases (the replay has no host-side boundary); depth 'block' runs the window eagerly.")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close_window()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning skips teardown after an exception: close everything here.
        self._close_window()

    # -- ranges ---------------------------------------------------------------------------------

    def _open(self, name: str, nvtx_kind: str = "push") -> None:
        nvtx_id = None
        if self._use_nvtx:
            if nvtx_kind == "push":
                nvtx.range_push(name)
            else:
                nvtx_id = nvtx.range_start(name)
        record = None
        if self.record_function and profiler_recording():  # recorded nowhere otherwise (profiler_recording)
            record = torch.profiler.record_function(name)
            record.__enter__()
        self._stack.append(_Open(name, nvtx_kind if self._use_nvtx else None, nvtx_id, record))

    def _close_top(self) -> str:
        item = self._stack.pop()
        if item.record is not None:
            item.record.__exit__(None, None, None)
        if item.nvtx_kind == "push":
            nvtx.range_pop()
        elif item.nvtx_kind == "start":
            nvtx.range_end(item.nvtx_id)
        return item.name

    def _close(self, name: str) -> None:
        """Close ranges down to and including the innermost one called ``name`` (if it is open)."""
        if any(item.name == name for item in self._stack):
            while self._close_top() != name:
                pass

    def _close_all(self) -> None:
        while self._stack:
            self._close_top()

    def _depth_at_least(self, depth: str) -> bool:
        return DEPTHS.index(self.depth) >= DEPTHS.index(depth)

    # -- window ---------------------------------------------------------------------------------

    def _open_window(self, pl_module: pl.LightningModule) -> None:
        self._in_window = True
        if self._depth_at_least("block"):
            for name, module in module_ranges(pl_module, self._depth_at_least("module"), self.module_names,
                                              self.module_types):
                self._handles.append(module.register_forward_pre_hook(self._pre_hook(name)))
                self._handles.append(module.register_forward_hook(self._post_hook(name), always_call=True))
        if self._depth_at_least("op"):
            self._annotate_on = (self._use_nvtx, self.record_function)
            enable_ranges(*self._annotate_on)

    def _close_window(self) -> None:
        self._close_all()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._annotate_on is not None:
            disable_ranges(*self._annotate_on)
            self._annotate_on = None
        self._in_window = False

    def _pre_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self._open(name)

        return hook

    def _post_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self._close(name)

        return hook

    # -- Lightning hooks ------------------------------------------------------------------------

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        step = self._phases.batch_start(trainer)
        if not self._window.contains(step):
            return
        if not self._in_window:
            self._open_window(pl_module)
        self._open(STEP_RANGE)
        self._open(f"{STEP_RANGE}/{step}", nvtx_kind="start")
        if self._depth_at_least("phase"):
            self._open(self._phases.phase)  # forward, or "cuda graph" for a replayed step

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._phases.before_backward()
        if self._in_window and self._depth_at_least("phase"):
            self._close("forward")
            self._open("backward")

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._phases.after_backward()
        if self._in_window and self._depth_at_least("phase"):
            self._close("backward")

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._phases.before_optimizer_step()
        if self._in_window and self._depth_at_least("phase") and not self._phases.graphed:
            self._close("forward")  # a step without backward (not in lmtrain's modes, but cheap to handle)
            self._open("optimizer")

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._phases.batch_end(trainer)
        if not self._in_window:
            return
        self._close(STEP_RANGE)
        if self._phases.leaves(self._window):
            self._close_window()
            rank_zero_info(f"NVTXRanges: window closed after step {self._phases.step}.")


def module_ranges(root: nn.Module, with_children: bool, patterns: list[str] | None = None,
                  type_names: list[str] | None = None) -> list[tuple[str, nn.Module]]:
    """(range name, module) for each repeated block of ``root`` and, optionally, the blocks' children.

    Blocks are the elements of the top-most ``nn.ModuleList`` containers, named by their path below
    the module that holds the list (``blocks.3`` for ``root.model.blocks[3]``). With ``with_children``,
    each block's direct children are added (``blocks.3.attn``) and so are modules whose class name is
    in ``type_names``. ``patterns`` (fnmatch) choose among the names; None keeps every block and the
    children matching :data:`DEFAULT_MODULE_PATTERNS`. Modules reachable by several paths (shared
    submodules) get one range, under their first name.
    """
    out: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()
    block_paths: list[str] = []
    drop_prefix = ""

    def keep(name: str, is_block: bool) -> bool:
        if patterns is not None:
            return any(fnmatch.fnmatchcase(name, p) for p in patterns)
        return is_block or any(fnmatch.fnmatchcase(name, p) for p in DEFAULT_MODULE_PATTERNS)

    def add(name: str, module: nn.Module) -> None:
        if id(module) not in seen:
            seen.add(id(module))
            out.append((name, module))

    for path, container in root.named_modules():
        if not isinstance(container, nn.ModuleList) or any(path.startswith(b + ".") for b in block_paths):
            continue
        parent, _, list_name = path.rpartition(".")
        drop_prefix = drop_prefix or (parent + "." if parent else "")
        for i, block in enumerate(container):
            block_name = f"{list_name}.{i}"
            block_paths.append(f"{path}.{i}")
            if keep(block_name, True):
                add(block_name, block)
            if with_children:
                for child_name, child in block.named_children():
                    if keep(f"{block_name}.{child_name}", False):
                        add(f"{block_name}.{child_name}", child)
    if with_children and type_names:
        for path, module in root.named_modules():
            if type(module).__name__ in type_names and path:
                add(path.removeprefix(drop_prefix), module)
    return out
