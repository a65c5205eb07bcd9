r"""The peak memory plan of a training step, printed when ``minillama train`` / ``finetune`` start,
and the ``--max-memory`` limit held to it.

Seven parts, in bytes:

* **runtime**: what the process holds besides the model's arrays when the plan is made: Python,
  NumPy (and Numba) with their modules, the tokenizer, the data. Measured, not estimated: the
  resident memory (``VmRSS``) less the weights, adapters and AdamW moments already allocated
  (0 on a GPU backend, whose plan counts device memory, or where the resident size is unknown);
* **weights** as held: float arrays at the compute dtype, GGML-quantized matrices at their block
  size (a quantized base stays quantized);
* **adapters**: the LoRA A and B matrices (none for a full run);
* **gradients**: one array per *trainable* parameter, twice with ``--grad-accum`` > 1 (the sum
  and the micro-batch being formed). With LoRA the frozen weights get no gradient and no AdamW
  state: only the adapters count here and in the optimizer;
* **optimizer**: AdamW's two moments per trainable parameter;
* **activations** for a (B, T) micro-batch: what the forward saves for the backward (the ops'
  ``ctx``), counted op by op from what each backend's forward keeps (:func:`block_saved`,
  :func:`head_saved`), plus the backward's workspace (:func:`workspace_bytes`).

B x T is the shape the run makes: ``--batch-size`` x ``--context`` for pretraining (every window
fills the context); for fine-tuning the longest micro-batch the data makes (padded batches are
as long as their longest example, packed rows at most ``--context``), not ``--context`` itself.

With ``recompute`` (gradient checkpointing, :mod:`minillama.model.recompute`) the forward keeps only
each block's input (B, T, D); the backward rebuilds one block's saved set at a time:
L B T D + one block + the head, instead of L blocks + the head.

Not counted: the transient buffers inside one op (a dequantized tile, a BLAS panel), the Numba
kernels loaded on the first step, and what the allocator keeps of freed memory.

:func:`saved_bytes` measures the same quantity on a real tape (every distinct array buffer it
holds, weights excluded); the tests hold the estimate to it. :func:`settle` prints the plan and
holds it to ``--max-memory``: over the limit it turns on recompute when that alone fits (and says
so), else it refuses in one line naming the largest batch size and context that fit.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from minillama.core.errors import MinillamaError
from minillama.core.quant import QuantMatrix

GiB = 1024 ** 3


def _nbytes(a) -> int:
    return int(a.nbytes)


#: each linear's input inside a block, and the LoRA targets that read it
_INPUTS = {"h": ("q", "k", "v"), "a": ("o",), "n": ("gate", "up"), "g": ("down",)}


def block_saved(model, B: int, T: int) -> int:
    """Bytes one block's forward keeps for its backward on ``model``'s backend: the two norms'
    inputs and 1/rms, the linears' inputs, the attention's and the activation's own ctx, and the
    LoRA products. N = B T rows; e = the dtype's size."""
    cfg, e, name = model.cfg, model.dtype.itemsize, model.backend.name
    N, D, F, H = B * T, cfg.dim, cfg.hidden_dim, cfg.n_heads
    qd, kvd = H * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    width = {"h": D, "a": qd, "n": D, "g": F}
    if name == "numba":  # q, k, v, the output o (which is also wo's input: a view) and lse (H,)
        att, width["a"] = 2 * qd + 2 * kvd + H, 0
    else:  # q (numpy: scaled q and o), k, v and P (H, T) per row
        att = (2 if name == "numpy" else 1) * qd + 2 * kvd + H * T
    act = {"swiglu": 3 * F if name == "numba" else 4 * F, "gelu": 2 * F,
           "relu": F / e}[cfg.ffn]  # a, b, sigma(a), silu(a) | a, tanh u | the mask a > 0
    lora = model.lora
    targets = set(lora.lc.targets) if lora is not None else set()
    dropout = lora is not None and lora.lc.dropout > 0
    def kept(k):  # with dropout an input read only by targets is kept masked, by the targets
        readers = {t for t in _INPUTS[k] if t != "up" or cfg.ffn == "swiglu"}
        return not (dropout and readers <= targets)

    n = sum(w for k, w in width.items() if kept(k)) + 2 * (D + 1) + att + act
    if lora is not None:
        for key in lora.targets:
            if key.startswith("layers.0."):
                inp = model.params[key].shape[1]
                n += lora.lc.rank + (2 * inp if dropout else 0)  # u = x A^T; masked x, mask
    return int(N * n * e)


def head_saved(model, B: int, T: int) -> int:
    """Bytes the loss head keeps: the final norm (its input, 1/rms), its output and the (N, V)
    logits gradient (the fused head of the numpy/numba backends, with dx (N, D)) or the softmax
    probabilities (the reference); plus the token ids (int64)."""
    cfg, e = model.cfg, model.dtype.itemsize
    N, D, V = B * T, cfg.dim, cfg.vocab_size
    n = 2 * N * D + N + N * V
    if _fused_head(model):
        n += N * D
    return n * e + 17 * N  # ids, targets (int64), the valid mask


def _fused_head(model) -> bool:
    """Whether the loss head is the numpy/numba fused one (logits and their gradient in one
    (N, V) buffer), not the composed linear + cross-entropy (the reference, a quantized head)."""
    return model.backend.name in ("numpy", "numba") and not isinstance(model.output_weight,
                                                                       QuantMatrix)


def workspace_bytes(model, B: int, T: int) -> int:
    """What the backward allocates beside the saved activations, at most: about one block's
    saved set (its gradients), or the loss head's backward if larger: dW_out (V, D) of the fused
    head, or the composed head's (N, V) gradient built from a copy of the probabilities."""
    cfg, e = model.cfg, model.dtype.itemsize
    N, V = B * T, cfg.vocab_size
    head = V * cfg.dim * e if _fused_head(model) else 2 * N * V * e
    return max(block_saved(model, B, T), head)


@dataclass
class MemoryPlan:
    """The parts of the peak, in bytes (see the module docstring)."""

    weights: int
    adapters: int
    gradients: int
    optimizer: int
    activations: int
    workspace: int
    B: int
    T: int
    recompute: bool
    lora: bool
    runtime: int = 0
    grad_accum: int = 1

    @property
    def total(self) -> int:
        return (self.runtime + self.weights + self.adapters + self.gradients + self.optimizer
                + self.activations + self.workspace)

    @property
    def fixed(self) -> int:
        """The parts that do not depend on the batch: runtime, weights, adapters, gradients and
        AdamW."""
        return self.runtime + self.weights + self.adapters + self.gradients + self.optimizer

    def lines(self) -> list[str]:
        f = _fmt
        frozen = (" (frozen weights: no gradient, no AdamW state)" if self.lora else "")
        act = f"activations {f(self.activations)} for B x T = {self.B} x {self.T}" + (
            " (--recompute: block inputs + one block)" if self.recompute else "")
        run = f"runtime {f(self.runtime)} + " if self.runtime else ""
        return [f"memory plan: {f(self.total)} at peak = {run}weights {f(self.weights)}"
                f"{' + adapters ' + f(self.adapters) if self.lora else ''} + gradients "
                f"{f(self.gradients)} + AdamW {f(self.optimizer)}{frozen} + {act} + backward "
                f"workspace {f(self.workspace)}"]


def _fmt(n: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def activation_bytes(model, B: int, T: int, recompute: bool = False) -> int:
    """Saved activations of one (B, T) micro-batch: L blocks + the head, or with ``recompute``
    the L block inputs (B, T, D) + one block + the head."""
    L, e = model.cfg.n_layers, model.dtype.itemsize
    block, head = block_saved(model, B, T), head_saved(model, B, T)
    if recompute:
        return L * B * T * model.cfg.dim * e + block + head
    return L * block + head


def plan(model, trainable: dict, B: int, T: int, grad_accum: int = 1,
         recompute: bool = False, resident: int | None = None) -> MemoryPlan:
    """The :class:`MemoryPlan` of training ``trainable`` (a dict of arrays: the adapters, or the
    model's parameters) of ``model`` on (B, T) micro-batches. Quantized matrices are frozen: they
    count as weights only. ``resident``: the process's resident bytes now (with the model and its
    optimizer built), from which the runtime part is what the other parts do not account for;
    None: no runtime part."""
    lora = model.lora is not None
    weights = sum(_nbytes(v) for v in model.params.values())
    adapters = sum(_nbytes(v) for v in model.lora.params.values()) if lora else 0
    learn = sum(_nbytes(v) for v in trainable.values() if not isinstance(v, QuantMatrix))
    grads = learn * (2 if grad_accum > 1 else 1)
    runtime = 0 if resident is None else max(0, resident - weights - adapters - 2 * learn)
    return MemoryPlan(weights=weights, adapters=adapters, gradients=grads, optimizer=2 * learn,
                      activations=activation_bytes(model, B, T, recompute),
                      workspace=workspace_bytes(model, B, T), B=B, T=T, recompute=recompute,
                      lora=lora, runtime=runtime, grad_accum=grad_accum)


# ---------------------------------------------------------------------------------------------
# measuring a tape, and the memory there is
# ---------------------------------------------------------------------------------------------
def _owner(a):
    """The array that owns ``a``'s buffer (views point at it through ``.base``)."""
    while getattr(a, "base", None) is not None and hasattr(a.base, "nbytes") \
            and hasattr(a.base, "shape"):
        a = a.base
    return a


def saved_bytes(tape, exclude=()) -> int:
    """Bytes of every distinct array buffer reachable from ``tape`` (tuples, lists, dicts and
    objects' attributes), each owner counted once; the buffers of the arrays in ``exclude`` (the
    weights, RoPE tables) and quantized matrices are left out."""
    skip = {id(_owner(a)) for a in exclude if hasattr(a, "nbytes")}
    seen, total, stack = set(), 0, [tape]
    while stack:
        o = stack.pop()
        if isinstance(o, (list, tuple)):
            stack.extend(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, QuantMatrix) or callable(o) or isinstance(o, (str, bytes, int,
                                                                         float)):
            continue
        elif hasattr(o, "nbytes") and hasattr(o, "shape"):
            own = _owner(o)
            if id(own) not in seen and id(own) not in skip:
                seen.add(id(own))
                total += int(own.nbytes)
        elif hasattr(o, "__slots__") or hasattr(o, "__dict__"):
            names = getattr(o, "__slots__", ()) or vars(o).keys()
            stack.extend(getattr(o, k, None) for k in names)
    return total


def model_buffers(model) -> list:
    """The arrays a tape may point at that are not activations: the weights, adapters and the
    position tables."""
    out = list(model.params.values())
    if model.lora is not None:
        out += list(model.lora.params.values())
    out += [getattr(model, k) for k in ("cos", "sin", "pos_table") if hasattr(model, k)]
    return out


def parse_size(text: str) -> int:
    """``"6G"``, ``"512MiB"``, ``"2.5GB"``, ``"100000"`` (bytes) -> bytes (binary units)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise MinillamaError(f"--max-memory: cannot read {text!r} (e.g. 8G, 512M, 2.5GiB)")
    n = float(m.group(1)) * 1024 ** "bkmgt".index((m.group(2) or "b").lower())
    if n <= 0:
        raise MinillamaError(f"--max-memory must be > 0, got {text!r}")
    return int(n)


def available_bytes(backend) -> int | None:
    """Free memory where the arrays live: the GPU's for CuPy, else the host's MemAvailable."""
    if backend.device != "cpu":
        try:
            free, _ = backend.xp.cuda.runtime.memGetInfo()
            return int(free)
        except Exception:  # no device query: no limit from it
            return None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def resident_bytes() -> int | None:
    """The process's resident memory now (``VmRSS`` of ``/proc/self/status``); None where the
    system does not say."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _largest(ok, hi: int) -> int | None:
    """The largest v in [1, hi] with ``ok(v)`` (ok holds up to some value, not beyond), or None."""
    lo, best = 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if ok(mid):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def settle(model, trainable: dict, B: int, T: int, grad_accum: int, recompute: bool,
           max_memory: int | None, say, shorter=None) -> MemoryPlan:
    """Print the plan of training ``trainable`` on (B, T) micro-batches and hold it to
    ``max_memory`` (bytes, the whole process at the step's peak). Over the limit: when recompute
    (the same gradients) brings it under, the returned plan has ``recompute`` on and one line says
    so; otherwise a :class:`MinillamaError` names the largest ``--batch-size`` and ``--context``
    that fit (the batch is never changed here: it changes the results). ``shorter(t)``: what a
    ``--context`` of t < T costs the data, as (more flags, what they drop) or None when it leaves
    nothing to train on; default: nothing (windows of text are cut shorter). Without a limit, one
    line warns when the step needs more than the free memory."""
    resident = None if model.backend.device != "cpu" else resident_bytes()

    def at(b, t, rec, accum=grad_accum):
        return plan(model, trainable, b, t, accum, rec, resident)

    p = at(B, T, recompute)
    if max_memory is not None and p.total > max_memory and not recompute:
        r = at(B, T, True)
        if r.total <= max_memory:
            say(f"memory plan: {_fmt(p.total)} exceeds --max-memory {_fmt(max_memory)}; "
                f"recomputing each block in the backward brings it to {_fmt(r.total)} "
                f"(--recompute turned on: the same gradients, one more forward a step)")
            p = r
    for line in p.lines():
        say(line)
    if max_memory is not None:
        if p.total > max_memory:
            raise MinillamaError(_refusal(at, p, max_memory, shorter or (lambda t: ("", ""))))
        return p
    free = available_bytes(model.backend)
    rest = p.total - p.runtime - p.weights - p.adapters - p.optimizer
    if free is not None and rest > free:
        say(f"memory plan: the step needs {_fmt(rest)} more, {_fmt(free)} is available"
            + ("" if p.recompute else "; try --recompute (or a smaller --batch-size / --context)"))
    return p


def _refusal(at, p: MemoryPlan, limit: int, shorter) -> str:
    """The one line of a plan ``p`` over ``limit``: what fits, at the run's recompute setting and
    with recompute; a smaller batch is offered with the ``--grad-accum`` that keeps the examples
    per step where one does, a shorter context with what it drops (``shorter``)."""
    B, T, A = p.B, p.T, p.grad_accum
    head = (f"the memory plan, {_fmt(p.total)} for B x T = {B} x {T}"
            f"{' with --recompute' if p.recompute else ''}, exceeds --max-memory {_fmt(limit)}")
    if not p.recompute:
        head += f" ({_fmt(at(B, T, True).total)} with --recompute)"

    def option(flags: str, why: str, q: MemoryPlan) -> str:
        return f"{flags} ({why + ', ' if why else ''}{_fmt(q.total)})"

    fits, best_b, best_t = [], 0, 0
    accum = max(A, 2)  # a smaller batch is likely made up with --grad-accum: two gradients
    for rec in (False, True) if not p.recompute else (True,):
        flag = "--recompute " if rec and not p.recompute else ""
        b = _largest(lambda v, r=rec: at(v, T, r, accum).total <= limit, B - 1)
        if b is not None and b > best_b:
            k = B * A // b if (B * A) % b == 0 else None
            fits.append(option(f"{flag}--batch-size {b}" + (f" --grad-accum {k}" if k else ""),
                               f"the same {B * A} examples a step" if k else "",
                               at(b, T, rec, accum)))
            best_b = b
        t = _largest(lambda v, r=rec: at(B, v, r).total <= limit, T - 1)
        if t is not None and t > best_t and shorter(t) is not None:
            more, why = shorter(t)
            fits.append(option(f"{flag}--context {t}{more}", why, at(B, t, rec)))
            best_t = t
    if fits:
        return f"{head}; what fits: {', or '.join(fits)}"
    if p.fixed > limit:
        why = (f"the runtime, weights{', adapters' if p.lora else ''}, gradients and AdamW alone "
               f"take {_fmt(p.fixed)}")
    else:
        why = f"--batch-size 1 --context 1 --recompute plans {_fmt(at(1, 1, True).total)}"
    return f"{head}; nothing fits: {why}"
