"""lmtrain's optimizers: AdamW over fp32 master weights for bf16 matrix weights, and AdamW inside the backward pass.

:class:`InBackwardAdamW` (``model.optimizer_in_backward``) updates each parameter as soon as its gradient is complete
(see its docstring); :func:`check_in_backward_run` and :func:`check_master_weights_run` refuse the trainer
settings each cannot work with. The rest of this docstring is about :class:`MasterWeightAdamW`.

Under ``bf16-mixed`` (autocast to bf16) the weights are fp32 and every step moves, per matrix parameter:

* forward: autocast casts the fp32 weight to bf16 (read 4 bytes, write 2): 6 bytes;
* backward: the bf16 matmul's weight gradient is cast to fp32 into ``.grad`` (read 2, write 4): 6 bytes;
* AdamW: reads param, grad, m, v and writes param, m, v, all fp32: 28 bytes;

40 bytes in all (more with activation checkpointing, which casts the weights again). :class:`MasterWeightAdamW`
keeps those weights in the model *in bf16*, holding exactly the values autocast would have cast to, and keeps the
fp32 master copy in its own state. The forward pass then needs no cast (autocast leaves a bf16 tensor alone), the
gradient stays bf16 (it is the output of a bf16 matmul, so it holds exactly the values the fp32 ``.grad`` would
hold), and one fused update reads the bf16 gradient and the fp32 master, m and v and writes master, m, v and the
bf16 weight: 2 + 12 + 12 + 2 = 28 bytes per parameter. Memory is unchanged: bf16 weight and gradient plus fp32
master, m and v are 16 bytes per parameter, as fp32 weight, gradient, m and v are (and autocast's per-step bf16
weight copies are gone).

The update is ``torch.optim.AdamW``'s (decoupled weight decay) on the fp32 master, and the bf16 weight is the
master rounded to nearest (ties to even), what ``.to(torch.bfloat16)`` and autocast do. So with one backward pass
per step a run takes the same steps as under ``bf16-mixed`` with ``torch.optim.AdamW``. Not quite so where the
gradient is touched in bf16 before the update: gradient accumulation over several backward passes sums in bf16,
and gradient clipping computes the norm and scales the gradient in bf16.

Which parameters to convert: exactly those that autocast casts to bf16, the weights of matrix products
(``nn.Linear`` weights and biases). Parameters used in fp32 (norm gains, an embedding table read by
``F.embedding``) stay fp32 and get an ordinary ``torch.optim.AdamW`` step; a weight used both ways (an embedding
tied to the output head) must stay fp32.

On a CUDA device the bf16 parameters of a param group are updated by one Triton kernel, eight tensors per launch
(the 2.7B model's 161 matrices in 21 launches); elsewhere (CPU, Triton missing or run by its interpreter) by the same
arithmetic in torch operations.

``state_dtype=torch.bfloat16`` keeps the whole state of the bf16 parameters in 16-bit tensors: 6 fewer bytes of
memory per parameter (10 instead of 16 with weight and gradient) and 10 fewer bytes of traffic per step (18 instead
of 28). Two changes:

* The fp32 master is stored *split*, without loss: its high 16 bits are the bf16 weight itself and its low 16 bits
  go to ``state["master_low"]`` (int16). The weight is the master rounded to nearest with ties toward zero (not to
  even), so the low bits tell which way it was rounded and the master is rebuilt exactly
  (:meth:`MasterWeightAdamW.master`). Rounded to even, one master in 2**17 per step (those exactly half-way)
  would give a weight one bf16 unit farther from zero than here; nothing else differs.
* The moments are bf16. This makes it a different optimizer, not the same arithmetic: they are computed in fp32 from
  their stored values and rounded back *stochastically* (each value becomes one of its two bf16 neighbours with
  probabilities that make the expected value the fp32 one). Rounding to nearest instead would freeze a moment whose
  per-step change is below half a bf16 unit (``1 - beta2 = 0.001`` of ``exp_avg_sq`` is; bf16 keeps 8 significant
  bits), biasing the update; stochastic rounding keeps the moments unbiased, at a relative noise of about 2**-9 per
  value and step.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from lmtrain.config import TrainerSettings
from lmtrain.errors import LmtrainError
from lmtrain.kernels import triton_interpreted

__all__ = ["OPTIMIZER_STATE_DTYPES", "MasterWeightAdamW", "bf16_with_masters", "join_master", "linear_weights",
           "round_bf16_stochastic", "split_master", "weight_decay_groups"]

_MOMENT_KEYS = ("exp_avg", "exp_avg_sq")
_STATE_DTYPES = (torch.float32, torch.bfloat16)
#: ``state_dtype`` choices by name (``LMModule``'s ``optimizer_state_dtype``, ``lmtrain.config.OPTIMIZER_STATES``).
OPTIMIZER_STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Elements per program: 8 per thread at 8 warps (two 16-byte loads of each fp32 tensor). On an H100 (2.7B, bench
# optimizer) 2048 x 8 warps and 4096 x 8 both reach 98% of copy bandwidth with fp32 moments; with bf16 moments 2048
# was the better of the two.
DEFAULT_BLOCK_SIZE = 2048
DEFAULT_NUM_WARPS = 8


class MasterWeightAdamW(torch.optim.Optimizer):
    """AdamW whose bf16 parameters are updated through fp32 master weights held in the optimizer state.

    Build the model in fp32 and pass the parameters to convert as ``bf16_params``: the constructor copies each
    one's fp32 value into ``state[p]["master"]`` and only then makes the parameter bf16 in place
    (``p.data = p.data.to(torch.bfloat16)``), so nothing is lost at initialisation::

        model = TransformerLM(cfg)  # fp32
        optimizer = MasterWeightAdamW(weight_decay_groups(model, 0.1), lr=3e-4,
                                      bf16_params=linear_weights(model))  # the linear weights are bf16 from here on

    State of a bf16 parameter, all of its shape: ``master`` (fp32) or, with ``state_dtype=torch.bfloat16``,
    ``master_low`` (int16, the master's low 16 bits; see the module docstring and :meth:`master`), ``exp_avg`` and
    ``exp_avg_sq`` (``state_dtype``); and ``step`` (a float32 scalar tensor on the parameter's device). Every
    other parameter must be fp32 and is stepped by a ``torch.optim.AdamW`` inside this optimizer, whose state
    entries are this optimizer's (``exp_avg``, ``exp_avg_sq``, ``step``). Both paths read ``lr``, ``betas``,
    ``eps`` and ``weight_decay`` from this optimizer's param groups at every step, so a schedule that sets
    ``group["lr"]`` here drives both.
    ``state_dict``/``load_state_dict`` save and restore everything, masters included.

    The bf16 path reads no device value on the host in :meth:`step` (step counts and a tensor ``lr`` are read by
    the kernel), so it can be captured in a CUDA graph whatever ``capturable`` says; ``capturable`` configures the
    fp32 path's AdamW, and must be True for a captured step.

    Args:
        params: parameters or param groups, as for ``torch.optim.AdamW`` (a group may set ``lr``, ``betas``,
            ``eps``, ``weight_decay``). Every parameter must be fp32 when given.
        lr: learning rate: a number, or a 0-dim tensor on the parameters' device (for a step captured in a CUDA
            graph; the schedule then fills it in place).
        betas: coefficients of the running averages of the gradient and its square, each in [0, 1).
        eps: added to the denominator's square root, >= 0.
        weight_decay: decoupled weight decay coefficient (the master is multiplied by ``1 - lr * weight_decay``).
        bf16_params: the parameters (a subset of ``params``) to store in bf16 with an fp32 master; see above.
        fused: None: a Triton kernel for the bf16 parameters on a CUDA device (torch operations elsewhere) and
            the fused ``torch.optim.AdamW`` for the fp32 parameters when they are all on a CUDA device.
            True: require the Triton kernel (CUDA parameters, Triton installed and not interpreted) and fuse the
            fp32 AdamW. False: torch operations for both.
        capturable: the fp32 path's AdamW keeps its step counts on the device (``capturable=True``), for a step
            captured as a CUDA graph.
        block_size: elements one program of the Triton kernel updates (a power of two, 128 .. 65536; the default
            ``DEFAULT_BLOCK_SIZE``, 8 per thread at 8 warps: two 16-byte loads of each fp32 tensor); also the
            attribute ``block_size``, which may be set between steps (checked when set; ``python -m lmtrain bench
            optimizer`` times the choices).
        num_warps: warps per program of the Triton kernel (1, 2, 4, 8 or 16); also the attribute ``num_warps``.
        state_dtype: ``torch.float32`` (default: fp32 master and moments; the update is AdamW's) or
            ``torch.bfloat16`` (the master split into the bf16 weight and its low 16 bits, stochastically rounded
            bf16 moments; see the module docstring). The fp32 parameters' state stays fp32 either way.
        params_are_masters: the ``bf16_params`` stay fp32 because they are the masters themselves: FSDP2's sharded
            parameters, which its ``MixedPrecisionPolicy`` all-gathers in bf16 for every forward and backward pass
            (so the compute already reads bf16 weights and nothing need be converted here). Their state is the
            moments (in ``state_dtype``: ``torch.bfloat16`` gives the compact, stochastically rounded moments) and
            the step count; gradients are fp32 (FSDP2's reduce-scatter dtype). A parameter that is a ``DTensor`` is
            updated on its local shard (``to_local()``), by the Triton kernel on a CUDA device; its state tensors
            are ``DTensor`` s of the same placement, as ``torch.optim.AdamW``'s are.
        masters: fp32 masters of ``bf16_params`` that are bf16 already (:func:`bf16_with_masters` converted them
            before a wrapper such as ``DistributedDataParallel`` bucketed them, which must see the dtype they train
            in): each becomes its parameter's master instead of a copy of the parameter.
        seed: seed of the stochastic rounding's random bits (``state_dtype=torch.bfloat16``). The Triton kernel
            hashes each element's offset with a key made of the seed, the launch and the step count (so two runs
            with one seed round alike, a resumed run as an uninterrupted one, and a replayed CUDA graph draws new
            bits every step); the torch-operation path draws them from generators seeded with it, the step count
            and the parameter's index on the CPU, from the device's default generator elsewhere.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        bf16_params: Iterable[torch.Tensor] = (),
        fused: bool | None = None,
        capturable: bool = False,
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_warps: int = DEFAULT_NUM_WARPS,
        state_dtype: torch.dtype = torch.float32,
        params_are_masters: bool = False,
        masters: Mapping[torch.Tensor, torch.Tensor] | None = None,
        seed: int = 0,
    ) -> None:
        _check_hyperparameters(lr, betas, eps, weight_decay)
        if state_dtype not in _STATE_DTYPES:
            raise ValueError(f"state_dtype {state_dtype} is not supported. Fix: use torch.float32 or torch.bfloat16.")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}.")
        self.state_dtype, self.seed = state_dtype, seed
        self.params_are_masters = params_are_masters
        self._given_masters = {id(p): master for p, master in (masters or {}).items()}
        self.block_size, self.num_warps = block_size, num_warps  # checked by the setters
        self._convert_ids = {id(p) for p in bf16_params}
        self._master_ids: set[int] = set()
        self._ready = False
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self._ready = True
        given = {id(p) for group in self.param_groups for p in group["params"]}
        if not self._convert_ids <= given:
            raise ValueError(f"{len(self._convert_ids - given)} of the bf16_params are not among the optimizer's "
                             "parameters. Fix: pass every parameter in bf16_params in params (or its groups) too.")
        self._use_triton = _check_fused(fused, [p for p in _all_params(self) if id(p) in self._master_ids])
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) in self._master_ids:
                    self._make_master(p)
        self._fp32_groups = [[p for p in g["params"] if id(p) not in self._master_ids] for g in self.param_groups]
        fp32 = [p for ps in self._fp32_groups for p in ps]
        self._capturable = capturable
        self._inner: torch.optim.AdamW | None = None
        if fp32:
            inner_fused = fused is True or (fused is None and all(p.is_cuda for p in fp32))
            self._inner = torch.optim.AdamW(
                [dict(params=ps, **{k: v for k, v in g.items() if k != "params"})
                 for g, ps in zip(self.param_groups, self._fp32_groups, strict=True) if ps],
                lr=lr, fused=inner_fused or None, capturable=capturable)
        self._inner_fused = bool(self._inner is not None and self._inner.defaults.get("fused"))
        self._share_state()

    @property
    def uses_kernel(self) -> bool:
        """The bf16 parameters on a CUDA device are updated by the Triton kernel (not by torch operations)."""
        return self._use_triton

    @property
    def block_size(self) -> int:
        """Elements one program of the Triton kernel updates."""
        return self._block_size

    @block_size.setter
    def block_size(self, value: int) -> None:
        check_kernel_launch(value, DEFAULT_NUM_WARPS)
        self._block_size = value

    @property
    def num_warps(self) -> int:
        """Warps per program of the Triton kernel."""
        return self._num_warps

    @num_warps.setter
    def num_warps(self, value: int) -> None:
        check_kernel_launch(DEFAULT_BLOCK_SIZE, value)
        self._num_warps = value

    # -- construction -------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group while constructing (``torch.optim.Optimizer`` calls this per group); refused afterwards."""
        if self._ready:
            raise NotImplementedError("MasterWeightAdamW cannot take new param groups after construction. Fix: "
                                      "build a new optimizer with all the groups.")
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        for p in group["params"]:
            if id(p) in self._given_masters:
                master = self._given_masters[id(p)]
                if p.dtype != torch.bfloat16 or master.dtype != torch.float32 or master.shape != p.shape:
                    raise ValueError(f"a parameter of shape {tuple(p.shape)} given a master is {p.dtype}, its master "
                                     f"{master.dtype} of shape {tuple(master.shape)}. Fix: pass what "
                                     "bf16_with_masters returns.")
                if id(p) not in self._convert_ids:
                    raise ValueError("a parameter given a master is not in bf16_params. Fix: list it there too.")
                self._master_ids.add(id(p))
            elif id(p) in self._convert_ids:
                if p.dtype != torch.float32:
                    raise ValueError(f"a parameter of shape {tuple(p.shape)} in bf16_params is {p.dtype}; its fp32 "
                                     "value would be lost. Fix: build the model in fp32 and let the optimizer "
                                     "convert it.")
                self._master_ids.add(id(p))
            elif p.dtype == torch.bfloat16:
                raise ValueError(f"a parameter of shape {tuple(p.shape)} is bf16 but not in bf16_params: it would "
                                 "be updated in bf16. Fix: build the model in fp32 and list it in bf16_params (the "
                                 "optimizer converts it and keeps an fp32 master).")
            elif p.dtype != torch.float32:
                raise ValueError(f"a parameter of shape {tuple(p.shape)} is {p.dtype}. Fix: build the model in fp32 "
                                 "(list the matrices to store in bf16 in bf16_params).")

    @torch.no_grad()
    def _make_master(self, p: torch.Tensor) -> None:
        """Copy fp32 ``p`` into a new master, then store ``p`` (and any gradient it has) in bf16 (with
        ``params_are_masters``: only the moments, ``p`` stays as it is)."""
        state = self.state[p]
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        for moment in ("exp_avg", "exp_avg_sq"):
            state[moment] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.contiguous_format)
        if self.params_are_masters:
            return
        given = self._given_masters.pop(id(p), None)
        if given is not None:
            master = given.detach().to(p.device, torch.float32).contiguous()
        else:
            master = p.detach().clone(memory_format=torch.contiguous_format)
        if self._compact:
            weight, state["master_low"] = split_master(master)
        else:
            weight, state["master"] = master.to(torch.bfloat16), master
        if given is not None:
            p.data.copy_(weight)  # in place: a wrapper may hold views of it (the same unless the split rounded a tie)
            return
        grad, p.grad = p.grad, None
        p.data = weight
        if grad is not None:
            p.grad = grad.to(torch.bfloat16)

    @property
    def _compact(self) -> bool:
        """The masters are stored split (bf16 weight + low bits) and the moments are bf16."""
        return self.state_dtype == torch.bfloat16 and not self.params_are_masters

    @torch.no_grad()
    def master(self, p: torch.Tensor) -> torch.Tensor:
        """The fp32 master of bf16 parameter ``p``: ``state[p]["master"]`` itself, or (``state_dtype=torch.bfloat16``)
        a new tensor rebuilt exactly from ``p`` and ``state[p]["master_low"]``."""
        state = self.state[p]
        if self.params_are_masters:
            return p.detach()
        return state["master"] if "master" in state else join_master(p.detach(), state["master_low"])

    def _share_state(self) -> None:
        # One dict object per fp32 parameter serves both optimizers. It is filled here, as AdamW's first step
        # would fill it (step 0, zero moments), and not left empty until then: a distributed checkpoint loads into
        # the state this optimizer has (torch.distributed.checkpoint builds its template from it, and takes a
        # non-empty state as initialized), so an empty entry would load nothing and the resumed AdamW would start
        # from step 0.
        if self._inner is None:
            return
        on_device = self._capturable or self._inner_fused  # where AdamW keeps step counts (load_state_dict too)
        for group in self._inner.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["step"] = (torch.zeros((), dtype=torch.float32, device=p.device) if on_device
                                     else torch.tensor(0.0, dtype=torch.float32))
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if group.get("amsgrad"):
                        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                self._inner.state[p] = state

    # -- step ---------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One AdamW step of every parameter that has a gradient; ``closure`` (if given) computes them first."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._inner is not None:
            inner_groups = iter(self._inner.param_groups)
            for group, ps in zip(self.param_groups, self._fp32_groups, strict=True):
                if ps:
                    inner = next(inner_groups)
                    for key in ("lr", "betas", "eps", "weight_decay"):
                        inner[key] = group[key]
            self._inner.step()
        work = [(group, [p for p in group["params"] if id(p) in self._master_ids and p.grad is not None])
                for group in self.param_groups]
        stepped = [p for _, ps in work for p in ps]
        if not stepped:
            return loss
        for p in stepped:
            if p.grad.dtype != p.dtype:
                raise ValueError(f"the gradient of a {p.dtype} parameter of shape {tuple(p.shape)} is "
                                 f"{p.grad.dtype}. Fix: leave the gradients autograd makes (in the parameter's "
                                 "dtype), or cast them to it.")
        torch._foreach_add_([self.state[p]["step"] for p in stepped], 1.0)  # one launch per device
        launches = 0  # kernel launches so far in this step: each gets its own stochastic-rounding seed
        index = 0  # of the parameter among those stepped: its stochastic-rounding stream on the CPU
        for group, ps in work:
            beta1, beta2 = group["betas"]
            hyper = (group["lr"], beta1, beta2, group["eps"], group["weight_decay"])
            fused = []
            for p in ps:
                index += 1
                # A DTensor (FSDP2's shard) is updated through its local tensors.
                param, grad, state = _local(p), _local(p.grad), {k: _local(v) for k, v in self.state[p].items()}
                if self._use_triton and param.is_cuda and param.is_contiguous() and grad.is_contiguous():
                    fused.append((param, grad, state))
                else:
                    _update_torch(param, grad, state, *hyper, generator=self._generator(p, index))
            if fused:
                launches = _update_triton(fused, *hyper, block=self.block_size, num_warps=self.num_warps,
                                          seed=self.seed, first_launch=launches)
        return loss

    def _generator(self, p: torch.Tensor, index: int) -> torch.Generator | None:
        """The torch-operation path's stochastic-rounding generator for ``p``: on the CPU a new one seeded from
        ``seed``, the step count and ``index`` (so the bits depend on nothing else, as the kernel's: a resumed run
        draws what an uninterrupted one would, and the global generator is left alone); elsewhere the device's
        default one (a CUDA graph captures only that one without registration)."""
        if self.state_dtype != torch.bfloat16 or p.device.type != "cpu":
            return None
        step = int(self.state[p]["step"].item())
        return torch.Generator().manual_seed((self.seed * 1_000_003 + step * 65_537 + index) & (2**62 - 1))

    # -- checkpoints --------------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (masters included); a bf16 parameter saved without one gets its bf16 value.

        A state saved with ``state_dtype=torch.bfloat16`` holds the low halves of the masters, whose high halves
        are the bf16 weights: load the model's weights first (Lightning does), then this.

        ``torch.optim.Optimizer.load_state_dict`` would cast every floating state tensor to its parameter's dtype,
        bf16 here, so the bf16 parameters' states are set aside and placed by hand (fp32, on the parameter's
        device). Tensor learning rates end up on their group's device; where the group's ``lr`` was a tensor
        before, it keeps that tensor object (a captured CUDA graph reads its memory) with the loaded value.
        """
        params = _all_params(self)
        old_lrs = [group["lr"] for group in self.param_groups]
        saved = dict(state_dict)
        saved_state = dict(saved["state"])
        saved_params = [i for g in saved["param_groups"] for i in g["params"]]
        if len(saved_params) != len(params):
            raise ValueError(f"the saved state has {len(saved_params)} parameters, this optimizer "
                             f"{len(params)}. Fix: load a state saved from the same parameters.")
        masters = {p: saved_state.pop(i, {}) for i, p in zip(saved_params, params, strict=True)
                   if id(p) in self._master_ids}
        saved["state"] = saved_state
        super().load_state_dict(saved)
        for p, entry in masters.items():
            self.state[p] = self._loaded_master_state(p, entry)
        for group, old in zip(self.param_groups, old_lrs, strict=True):
            if group["params"]:
                group["lr"] = _lr_after_load(old, group["lr"], group["params"][0].device)
        for ps in self._fp32_groups:
            for p in ps:
                step = self.state[p].get("step")
                if (self._capturable or self._inner_fused) and isinstance(step, torch.Tensor):
                    self.state[p]["step"] = step.to(dtype=torch.float32, device=p.device)
        self._share_state()

    @torch.no_grad()
    def _loaded_master_state(self, p: torch.Tensor, entry: dict[str, Any]) -> dict[str, Any]:
        def fp32(value: Any) -> torch.Tensor:
            return torch.as_tensor(value).to(dtype=torch.float32, device=p.device, copy=True)

        def checked(key: str, value: torch.Tensor) -> torch.Tensor:
            if value.shape != p.shape:
                raise ValueError(f"the loaded {key} has shape {tuple(value.shape)}, its parameter "
                                 f"{tuple(p.shape)}. Fix: load a state saved from the same model.")
            return value.contiguous()

        # The master as saved: fp32, or split (the parameter, loaded before the optimizer, holds its high half).
        if self.params_are_masters:
            master = p.detach()
        elif "master" in entry:
            master = checked("master", fp32(entry["master"]))
        elif "master_low" in entry:
            low = checked("master_low", torch.as_tensor(entry["master_low"]).to(p.device, torch.int16, copy=True))
            master = join_master(p.detach(), low)
        else:
            warnings.warn(f"the loaded optimizer state has no fp32 master for a bf16 parameter of shape "
                          f"{tuple(p.shape)}; it starts from the parameter's bf16 value (the fp32 bits below bf16 "
                          "precision are lost).", stacklevel=3)
            master = p.detach().float()
        state = {"step": fp32(entry.get("step", 0.0)).reshape(())}
        if self._compact:
            weight, state["master_low"] = split_master(master)
            p.data.copy_(weight)  # the same unless the saved weight was a tie rounded to even
        elif not self.params_are_masters:
            state["master"] = master.contiguous()
        for key in _MOMENT_KEYS:  # saved in either dtype: rounded to nearest into this one
            moment = checked(key, fp32(entry[key])) if key in entry else torch.zeros_like(master)
            state[key] = moment.to(self.state_dtype)
        return state


# -- the update -----------------------------------------------------------------------------------


def _update_torch(param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], lr: float | torch.Tensor,
                  beta1: float, beta2: float, eps: float, weight_decay: float,
                  generator: torch.Generator | None = None) -> None:
    """The update in torch operations (CPU, no Triton, or a non-contiguous tensor); ``state["step"]`` counted.

    With the step count on the CPU and a number (or CPU tensor) for ``lr``, the arithmetic is
    ``torch.optim.AdamW``'s (single-tensor, not capturable) operation for operation. Otherwise the scalars stay
    device tensors, read by the operations themselves (no host-device synchronisation).
    """
    step = state["step"]
    if "master" in state:
        master = state["master"]
    else:  # split, or (no master in the state) the fp32 parameter is its own master
        master = join_master(param, state["master_low"]) if "master_low" in state else param
    stored_m, stored_v = state["exp_avg"], state["exp_avg_sq"]
    # bf16 moments: computed in fp32, stored back with stochastic rounding.
    exp_avg, exp_avg_sq = (stored_m, stored_v) if stored_m.dtype == torch.float32 else (stored_m.float(),
                                                                                       stored_v.float())
    g = grad.float()
    on_host = step.device.type == "cpu" and not (isinstance(lr, torch.Tensor) and lr.device.type != "cpu")
    if on_host:
        lr, t = float(lr), step.item()
        master.mul_(1 - lr * weight_decay)
        exp_avg.lerp_(g, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bias1, bias2_sqrt = 1 - beta1**t, (1 - beta2**t) ** 0.5
        denom = (exp_avg_sq.sqrt() / bias2_sqrt).add_(eps)
        master.addcdiv_(exp_avg, denom, value=-(lr / bias1))
    else:
        master.mul_(1 - lr * weight_decay)
        exp_avg.lerp_(g, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        # 1 - beta**t as -expm1(t log beta): no cancellation in float32 (beta2 = 0.999 at t = 1 would lose 4 digits).
        bias1 = -torch.expm1(step * math.log(beta1))
        bias2_sqrt = (-torch.expm1(step * math.log(beta2))).sqrt()
        neg_step_size = -lr / bias1
        denom = (exp_avg_sq.sqrt() / (bias2_sqrt * neg_step_size)).add_(eps / neg_step_size)
        master.addcdiv_(exp_avg, denom)
    if exp_avg is not stored_m:
        stored_m.copy_(round_bf16_stochastic(exp_avg, generator))
        stored_v.copy_(round_bf16_stochastic(exp_avg_sq, generator))
    if "master" in state:
        param.copy_(master)  # rounds to nearest, ties to even
    elif "master_low" in state:
        weight, low = split_master(master)
        param.copy_(weight)
        state["master_low"].copy_(low)


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``master`` -> (bf16 weight, int16 low 16 bits): the weight is the master rounded to nearest, ties
    toward zero, so that :func:`join_master` rebuilds the master exactly (the kernel's split, in torch operations)."""
    bits = master.contiguous().view(torch.int32).long() & 0xFFFFFFFF
    low = bits & 0xFFFF
    top = torch.where(low > 0x8000, (bits >> 16) + 1, bits >> 16)
    return _as_int16(top).view(torch.bfloat16), _as_int16(low)


def join_master(weight: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The fp32 master from its bf16 ``weight`` and int16 ``low`` bits (the inverse of :func:`split_master`)."""
    low = low.long() & 0xFFFF
    top = weight.contiguous().view(torch.int16).long() & 0xFFFF
    bits = ((torch.where(low > 0x8000, top - 1, top) & 0xFFFF) << 16) | low
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).int().view(torch.float32)


def _as_int16(x: torch.Tensor) -> torch.Tensor:
    """Values in [0, 2**16) (int64) as the int16 tensor of the same 16 bits."""
    return torch.where(x >= 1 << 15, x - (1 << 16), x).to(torch.int16)


def round_bf16_stochastic(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """fp32 ``x`` rounded to bf16 stochastically: to the neighbour farther from zero with probability (the 16 low
    bits dropped) / 2**16, so that the expected value is ``x`` (the kernel's rounding, in torch operations)."""
    bits = x.view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)  # low 16 bits zero: exact


def _update_triton(items: list[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]], lr: float | torch.Tensor,
                   beta1: float, beta2: float, eps: float, weight_decay: float, *,
                   block: int = DEFAULT_BLOCK_SIZE, num_warps: int = DEFAULT_NUM_WARPS, seed: int = 0,
                   first_launch: int = 0) -> int:
    """The update of each ``(param, grad, state)`` (contiguous CUDA tensors of one param group) by the Triton kernel,
    eight tensors of a device per launch; reads ``lr`` (if a tensor) and the step counts from device memory.
    Returns ``first_launch`` plus the launches made (launch i's stochastic-rounding seed derives from ``seed``
    and i).

    The tensors' pointers are kernel arguments, so a CUDA graph that captures a launch replays it on the same
    tensors.
    """
    launch = first_launch
    from lmtrain.kernels.master_adamw import SLOTS

    by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]]] = {}
    for item in items:
        if item[0].numel() > 0:
            by_device.setdefault(item[0].device, []).append(item)
    for device, work in by_device.items():
        lr_on_device = isinstance(lr, torch.Tensor)
        rate = lr
        if lr_on_device and lr.device != device:
            if lr.device.type != "cpu":
                raise ValueError(f"lr is a tensor on {lr.device}, the parameters on {device}. Fix: keep lr on the "
                                 "parameters' device (or make it a number).")
            rate, lr_on_device = float(lr), False
        # Without a device lr, the kernel's lr pointer is unused: any tensor of the device will do.
        scalars = (rate if lr_on_device else work[0][2]["step"], 0.0 if lr_on_device else float(rate),
                   1 - beta1, beta2, 1 - beta2, math.log(beta1), math.log(beta2), eps, weight_decay)
        for i in range(0, len(work), SLOTS):
            chunk = work[i:i + SLOTS]
            args: list[Any] = []
            ends: list[int] = []
            blocks = 0
            for param, grad, state in chunk:
                # A parameter that is its own master (fp32) stands in for the unused master pointer.
                args += [param, grad, state.get("master", state.get("master_low", param)), state["exp_avg"],
                         state["exp_avg_sq"], state["step"],
                         param.numel()]
                blocks += -(-param.numel() // block)
                ends.append(blocks)
            for _ in range(SLOTS - len(chunk)):  # unused slots: never reached (their block range is empty)
                args += args[:6] + [0]
                ends.append(blocks)
            state_bf16 = chunk[0][2]["exp_avg"].dtype == torch.bfloat16
            param_is_master = chunk[0][0].dtype == torch.float32
            launch_seed = (seed * 1_000_003 + launch * SLOTS) & 0x7FFFFFFF  # slot k adds k
            _kernel()[(blocks,)](*args, *ends, *scalars, launch_seed, LR_ON_DEVICE=lr_on_device,
                                 STATE_BF16=state_bf16, PARAM_IS_MASTER=param_is_master, BLOCK=block,
                                 num_warps=num_warps)
            launch += 1
    return launch


@functools.cache
def _kernel() -> Any:
    """The Triton kernel (``lmtrain.kernels.master_adamw``), imported on first use: importing this module needs no
    Triton."""
    from lmtrain.kernels.master_adamw import master_adamw_kernel

    return master_adamw_kernel


# -- which parameters -----------------------------------------------------------------------------


def weight_decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW param groups of ``model``: its matrices (``ndim >= 2``) decay by ``weight_decay``, its vectors (the
    RMSNorm gains) do not."""
    params = list(model.parameters())
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def linear_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters of a ``TransformerLM`` that autocast casts to bf16, for ``MasterWeightAdamW``'s
    ``bf16_params``: every linear layer's weight (the blocks' and the output head's). The embedding table, read
    by ``F.embedding`` in fp32, and the norm gains are left out."""
    embedding = model.embedding.weight
    return [p for p in model.parameters() if p.ndim == 2 and p is not embedding]


# -- helpers --------------------------------------------------------------------------------------


@torch.no_grad()
def bf16_with_masters(params: Iterable[torch.Tensor]) -> dict[torch.Tensor, torch.Tensor]:
    """Store fp32 ``params`` in bf16 now, in place, and return their fp32 values: ``MasterWeightAdamW``'s
    ``masters``.

    For a model that a wrapper takes over before the optimizer exists: ``DistributedDataParallel`` builds its
    gradient buckets in the parameters' dtype when it wraps the model, so the linear weights must be bf16 by then
    (their gradients are then bf16, and so is their all-reduce: half the bytes of fp32).
    """
    masters = {}
    for p in params:
        if p.dtype != torch.float32:
            raise ValueError(f"a parameter of shape {tuple(p.shape)} is {p.dtype}. Fix: convert fp32 parameters.")
        masters[p] = p.detach().clone(memory_format=torch.contiguous_format)
        p.data = masters[p].to(torch.bfloat16)
    return masters


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The local tensor of a ``DTensor`` (a view of this rank's shard); any other tensor as it is."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _all_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _check_hyperparameters(lr: Any, betas: Any, eps: float, weight_decay: float) -> None:
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"lr is a tensor of shape {tuple(lr.shape)}. Fix: use a number or a 0-dim tensor.")
    elif not lr >= 0:
        raise ValueError(f"lr={lr!r}. Fix: use a learning rate >= 0.")
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise ValueError(f"betas={tuple(betas)!r}. Fix: use two numbers in [0, 1), e.g. (0.9, 0.999).")
    if not eps >= 0:
        raise ValueError(f"eps={eps!r}. Fix: use eps >= 0, e.g. 1e-8.")
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay={weight_decay!r}. Fix: use weight_decay >= 0.")


def check_kernel_launch(block_size: int, num_warps: int) -> None:
    """Refuse a ``block_size`` or ``num_warps`` the Triton kernel cannot take (``ValueError`` naming the fix)."""
    if not (isinstance(block_size, int) and 128 <= block_size <= 65536 and block_size & (block_size - 1) == 0):
        raise ValueError(f"block_size={block_size!r}. Fix: use a power of two from 128 to 65536, e.g. 2048.")
    if num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps={num_warps!r}. Fix: use 1, 2, 4, 8 or 16, e.g. 8.")


def _triton_usable() -> bool:
    return importlib.util.find_spec("triton") is not None and not triton_interpreted()


def _check_fused(fused: bool | None, masters: list[torch.Tensor]) -> bool:
    """Whether bf16 parameters on a CUDA device get the Triton kernel."""
    if fused is False:
        return False
    if fused is None:
        return _triton_usable()
    if not all(p.is_cuda for p in masters):
        raise ValueError("fused=True needs the bf16 parameters on a CUDA device. Fix: move the model to the GPU "
                         "first, or leave fused=None.")
    if not _triton_usable():
        raise ValueError("fused=True needs Triton (installed, and not run by its interpreter, TRITON_INTERPRET=1). "
                         "Fix: install Triton, or leave fused=None.")
    return True


def _lr_after_load(old: Any, new: Any, device: torch.device) -> Any:
    """The group's ``lr`` after a load: the old tensor refilled, the loaded tensor moved, or the loaded number."""
    if isinstance(old, torch.Tensor) and old.device == device:
        with torch.no_grad():
            old.copy_(new) if isinstance(new, torch.Tensor) else old.fill_(new)
        return old
    return new.to(device) if isinstance(new, torch.Tensor) else new


class InBackwardAdamW(torch.optim.Optimizer):
    """AdamW applied inside the backward pass, one parameter at a time, as each gradient is complete.

    Every parameter gets its own ``torch.optim.AdamW`` (the same hyperparameters as its group) and a
    ``register_post_accumulate_grad_hook``: when the backward pass has accumulated the parameter's gradient,
    :meth:`_apply_update` steps that AdamW and frees the gradient at once, so a step holds at most the
    gradients the backward pass is producing, never a full set. Updates happen only inside :meth:`step`,
    whose closure runs the backward pass; a backward pass outside it (a gradient check, say) leaves ``.grad``
    as usual.

    To Lightning this is the step's optimizer: its param groups carry ``lr`` and ``weight_decay`` (a
    ``LambdaLR`` schedules them, an LR monitor reads them), and each update copies its group's current ``lr``
    into the parameter's AdamW, so the schedule is the ordinary one's. ``state`` shares the per-parameter
    AdamW states (``exp_avg``, ``exp_avg_sq``, ``step``), so ``state_dict``/``load_state_dict`` save and
    restore them like ``torch.optim.AdamW``'s.

    With ``overlap`` on a CUDA device the updates run on a second stream, ordered after the gradient they
    read by an event, and the step's end makes the compute stream wait for that stream, so they overlap with
    the rest of the backward pass; elsewhere ``overlap`` changes nothing.

    Args:
        param_groups: groups as for ``torch.optim.AdamW`` (``params``, ``weight_decay``).
        lr: peak learning rate (the schedule scales the groups' ``lr``).
        betas: AdamW betas.
        eps: AdamW epsilon.
        fused: use the fused CUDA AdamW kernel per parameter.
        overlap: run the updates on a second CUDA stream.
        capturable: AdamW with ``capturable=True`` (step counts on the device), for a step captured as a CUDA
            graph; the groups' ``lr`` may then be device tensors.
    """

    def __init__(self, param_groups: list[dict[str, Any]], lr: float, betas: tuple[float, float], eps: float,
                 fused: bool = False, overlap: bool = False, capturable: bool = False) -> None:
        super().__init__(param_groups, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=0.0))
        self._fused = fused
        self._group_of: dict[torch.Tensor, dict[str, Any]] = {}
        self._adamw: dict[torch.Tensor, torch.optim.AdamW] = {}
        for group in self.param_groups:
            for p in group["params"]:
                self._group_of[p] = group
                self._adamw[p] = torch.optim.AdamW([p], lr=group["lr"], betas=group["betas"], eps=group["eps"],
                                                   weight_decay=group["weight_decay"], fused=fused,
                                                   capturable=capturable)
        self._share_state()
        self._stepping = False
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._adamw]
        cuda = overlap and any(p.is_cuda for p in self._adamw)
        self._stream = torch.cuda.Stream(device=next(iter(self._adamw)).device) if cuda else None
        # Gradients the side stream reads while a CUDA graph is being captured, kept until the step's end
        # (record_stream cannot mark a tensor during a capture).
        self._held: list[torch.Tensor] = []

    def _share_state(self) -> None:
        # AdamW fills its state dict in place on the first step, so one dict object serves both optimizers.
        for p, adamw in self._adamw.items():
            adamw.state[p] = self.state[p]

    def _on_grad(self, param: torch.Tensor) -> None:
        if self._stepping:
            self._apply_update(param)

    def _apply_update(self, param: torch.Tensor) -> None:
        """One AdamW update of ``param`` from its accumulated gradient, then free the gradient.

        The one place an update happens: the in-backward hook calls it on the current stream, or, with
        ``overlap``, on the side stream after an event recorded where the gradient was produced.
        """
        adamw = self._adamw[param]
        adamw.param_groups[0]["lr"] = self._group_of[param]["lr"]
        if self._stream is None:
            adamw.step()
            param.grad = None
            return
        ready = torch.cuda.current_stream(param.device).record_event()
        self._stream.wait_event(ready)
        with torch.cuda.stream(self._stream):
            adamw.step()
        # The compute stream may reuse the gradient's memory only after the side stream has read it.
        if torch.cuda.is_current_stream_capturing():
            self._held.append(param.grad)
        else:
            param.grad.record_stream(self._stream)
        param.grad = None

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Run ``closure`` (forward and backward pass); parameters are updated while its backward pass runs."""
        if closure is None:
            raise RuntimeError("InBackwardAdamW.step needs a closure that runs the backward pass: the updates "
                               "happen inside it.")
        self._stepping = True
        try:
            loss = closure()
        finally:
            self._stepping = False
        if self._stream is not None:
            # The next forward pass reads the updated parameters.
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
            self._held.clear()  # after the join: the side stream is done with them
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        # load_state_dict replaced self.state's dicts and the param groups' dicts: the schedule now sets ``lr``
        # in the new groups, which each update must read.
        self._share_state()
        self._group_of = {p: group for group in self.param_groups for p in group["params"]}

    def remove_hooks(self) -> None:
        """Detach from the parameters (no more in-backward updates)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def check_in_backward_run(settings: TrainerSettings) -> None:
    """Refuse trainer settings the in-backward optimizer (``model.optimizer_in_backward``) cannot work with.

    Args:
        settings: the trainer's settings (``LMModule.check_settings``: at parse time and when a fit starts).

    Raises:
        LmtrainError: gradient accumulation, gradient clipping, ``16-mixed``, or several ranks of a strategy other
            than FSDP2 and DDP (DDP is refused by ``lmtrain.distributed.check_strategy_options``).
    """
    field, why = "model.optimizer_in_backward", "updates each parameter as soon as its gradient exists, so"
    if settings.accumulate_grad_batches > 1:
        raise LmtrainError(field, f"{why} gradients cannot accumulate over trainer.accumulate_grad_batches="
                           f"{settings.accumulate_grad_batches} batches.",
                           "set trainer.accumulate_grad_batches: 1 (raise data.batch_size instead) or "
                           "model.optimizer_in_backward: false.")
    if settings.gradient_clip_val:
        raise LmtrainError(field, f"{why} no global gradient norm exists to clip by "
                           f"(trainer.gradient_clip_val={settings.gradient_clip_val}).",
                           "unset trainer.gradient_clip_val or set model.optimizer_in_backward: false.")
    if settings.precision == "16-mixed":
        raise LmtrainError(field, f"{why} it would update from loss-scaled fp16 gradients before the "
                           "scaler could unscale or skip them (trainer.precision=16-mixed).",
                           "use trainer.precision: bf16-mixed (no loss scaling) or "
                           "model.optimizer_in_backward: false.")
    if settings.several_ranks and settings.strategy not in ("fsdp", "ddp"):  # DDP: check_strategy_options
        raise LmtrainError(field, f"{why} under a strategy other than FSDP2 each rank would update from its own "
                           f"gradient, before it is averaged over the {settings.world_size} ranks.",
                           "use FSDP2 (trainer.strategy: lightning.pytorch.strategies.ModelParallelStrategy, "
                           "which runs the update after each gradient's reduce-scatter) or "
                           "model.optimizer_in_backward: false.")


def check_master_weights_run(settings: TrainerSettings) -> None:
    """Refuse trainer settings the master-weight optimizer (``model.master_weights``) cannot work with.

    Under FSDP2 the fp32 shards are the masters (``MasterWeightAdamW(params_are_masters=True)``); under DDP the
    linear weights are made bf16 before DDP wraps the model (:func:`bf16_with_masters`).

    Args:
        settings: the trainer's settings (``LMModule.check_settings``: at parse time and when a fit starts).

    Raises:
        LmtrainError: a precision other than ``bf16-mixed``, several ranks of a strategy other than FSDP2 and DDP,
            accumulation or clipping.
    """
    field, off = "model.master_weights", "or set model.master_weights: false."
    check_master_weights_precision(settings.precision)
    if settings.several_ranks and settings.strategy not in ("fsdp", "ddp"):
        raise LmtrainError(field, f"runs on one device, under DDP or under FSDP2 (this run: {settings.world_size} "
                           "ranks of another strategy).", "use trainer.strategy: ddp or FSDP2 " + off)
    if settings.accumulate_grad_batches > 1:
        raise LmtrainError(field, "keeps gradients in bf16, so accumulating them over trainer."
                           f"accumulate_grad_batches={settings.accumulate_grad_batches} batches would sum in bf16.",
                           "set trainer.accumulate_grad_batches: 1 (raise data.batch_size instead) " + off)
    if settings.gradient_clip_val:
        raise LmtrainError(field, "keeps gradients in bf16, where the clipping norm would be computed "
                           f"(trainer.gradient_clip_val={settings.gradient_clip_val}).",
                           "unset trainer.gradient_clip_val " + off)


def check_master_weights_precision(precision: str) -> None:
    """Refuse ``model.master_weights`` with a precision other than ``bf16-mixed`` (the trainer check and the
    memory planner's).

    Raises:
        LmtrainError: ``precision`` is not ``bf16-mixed``.
    """
    if precision != "bf16-mixed":
        raise LmtrainError("model.master_weights", f"stores the weights autocast's bf16 copies would hold, so it "
                           f"needs trainer.precision: bf16-mixed (this run: {precision}).",
                           "use trainer.precision: bf16-mixed or set model.master_weights: false.")
