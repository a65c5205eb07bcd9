"""The PyTorch LLaMA peer of the tests and the benchmarks: minillama's architecture on its own
parameter dict (Meta's names, (out, in) matrices, interleaved RoPE pairs) in PyTorch's ops, so
that the same weights go to both sides. Test machinery, never installed (torch is a test-only
dependency, imported here and nowhere in the package); tests import it as
``tests.support.torch_llama`` after ``pytest.importorskip("torch")``, and the scripts inside the
functions that use torch.

One model, two ways of computing it:

* the reference (:func:`t_forward` with :func:`t_rmsnorm`, :func:`t_rope`, :func:`t_attention`),
  written directly from the LLaMA paper / Meta's code with the obvious (not the efficient)
  choices: interleaved-pair RoPE via complex multiplication, K/V repeated per group with
  ``repeat_interleave``, an explicit additive causal mask; in any dtype, float64 included, its
  gradients from autograd (tests/model/test_torch_reference.py holds minillama to it);
* :class:`TorchLlama`, the peer the benchmarks time, in eager ops as a PyTorch user would write
  it: ``F.scaled_dot_product_attention``, RoPE from cos/sin tables, a KV cache, the training step
  with ``torch.optim.AdamW`` (and under bf16 autocast), greedy decode, and greedy decode with a
  static cache captured as one CUDA graph (scripts/bench_gpu.py on the GPU;
  scripts/bench_train.py and profile_step.py through :func:`train_step_fns` on the CPU).
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from minillama.core.config import ModelConfig


# ---------------------------------------------------------------------------------------------
# the reference
# ---------------------------------------------------------------------------------------------
def t_rmsnorm(x, g, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g


def t_rope(x, pos, theta):
    """x: (B, T, nh, hd); pairs (2i, 2i+1) as complex numbers times e^{i m theta_i}."""
    hd = x.shape[-1]
    freqs = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = torch.outer(pos.to(torch.float64), freqs)  # (T, hd/2)
    rot = torch.polar(torch.ones_like(ang), ang)
    xc = torch.view_as_complex(x.to(torch.float64).reshape(*x.shape[:-1], hd // 2, 2).contiguous())
    y = torch.view_as_real(xc * rot[None, :, None, :]).reshape(x.shape)
    return y.to(x.dtype)


def t_attention(q, k, v, start_pos=0):
    """q: (B, T, H, hd); k, v: (B, S, KVH, hd); plain MHA after repeating K/V per group."""
    B, T, H, hd = q.shape
    S, KVH = k.shape[1], k.shape[2]
    k = k.repeat_interleave(H // KVH, dim=2)
    v = v.repeat_interleave(H // KVH, dim=2)
    q, k, v = (a.transpose(1, 2) for a in (q, k, v))  # (B, H, *, hd)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    allowed = torch.arange(S)[None, :] <= (start_pos + torch.arange(T))[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2)


def t_forward(cfg: ModelConfig, p: dict, tokens):
    B, T = tokens.shape
    H, KVH, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    pos = torch.arange(T)
    x = p["tok_embeddings.weight"][tokens]
    for layer in range(cfg.n_layers):
        w = {n: p[f"layers.{layer}.{n}"] for n in (
            "attention_norm.weight", "attention.wq.weight", "attention.wk.weight",
            "attention.wv.weight", "attention.wo.weight", "ffn_norm.weight",
            "feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight")}
        h = t_rmsnorm(x, w["attention_norm.weight"], cfg.norm_eps)
        q = (h @ w["attention.wq.weight"].T).view(B, T, H, hd)
        k = (h @ w["attention.wk.weight"].T).view(B, T, KVH, hd)
        v = (h @ w["attention.wv.weight"].T).view(B, T, KVH, hd)
        q, k = t_rope(q, pos, cfg.rope_theta), t_rope(k, pos, cfg.rope_theta)
        x = x + t_attention(q, k, v).reshape(B, T, H * hd) @ w["attention.wo.weight"].T
        h = t_rmsnorm(x, w["ffn_norm.weight"], cfg.norm_eps)
        gate = torch.nn.functional.silu(h @ w["feed_forward.w1.weight"].T)
        x = x + (gate * (h @ w["feed_forward.w3.weight"].T)) @ w["feed_forward.w2.weight"].T
    x = t_rmsnorm(x, p["norm.weight"], cfg.norm_eps)
    head = p["tok_embeddings.weight"] if cfg.tie_embeddings else p["output.weight"]
    return x @ head.T


# ---------------------------------------------------------------------------------------------
# the eager peer (the same architecture and weight layout)
# ---------------------------------------------------------------------------------------------
class TorchLlama:
    """A LLaMA in PyTorch eager ops over the minillama parameter dict (names, (out, in) layout)."""

    def __init__(self, cfg: ModelConfig, params: dict, device: str):
        self.torch = torch
        self.cfg = cfg
        self.p = {k: torch.tensor(np.asarray(v), device=device, requires_grad=True)
                  for k, v in params.items()}
        hd = cfg.head_dim
        inv = cfg.rope_theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
        ang = np.outer(np.arange(cfg.max_seq_len, dtype=np.float64), inv)
        self.cos = torch.tensor(np.cos(ang), dtype=torch.float32, device=device)
        self.sin = torch.tensor(np.sin(ang), dtype=torch.float32, device=device)
        self.device = device
        self.sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def _rope(self, x, start: int):
        T = x.shape[1]
        c = self.cos[start:start + T][None, :, None, :]
        s = self.sin[start:start + T][None, :, None, :]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return self.torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)

    def forward(self, tok, start: int = 0, cache=None, last_only: bool = False):
        t, cfg, p = self.torch, self.cfg, self.p
        F = t.nn.functional
        B, T = tok.shape
        if T > 1 and start > 0:
            raise ValueError("the peer prefills from position 0 only")
        H, KVH, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        x = F.embedding(tok, p["tok_embeddings.weight"])
        for layer in range(cfg.n_layers):
            pre = f"layers.{layer}."
            h = t_rmsnorm(x, p[pre + "attention_norm.weight"], cfg.norm_eps)
            q = self._rope((h @ p[pre + "attention.wq.weight"].T).view(B, T, H, hd), start)
            k = self._rope((h @ p[pre + "attention.wk.weight"].T).view(B, T, KVH, hd), start)
            v = (h @ p[pre + "attention.wv.weight"].T).view(B, T, KVH, hd)
            if cache is not None:
                cache[0][layer][:, start:start + T] = k
                cache[1][layer][:, start:start + T] = v
                k = cache[0][layer][:, :start + T]
                v = cache[1][layer][:, :start + T]
            a = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                is_causal=(T > 1 and start == 0), enable_gqa=(KVH != H))
            x = x + a.transpose(1, 2).reshape(B, T, H * hd) @ p[pre + "attention.wo.weight"].T
            h2 = t_rmsnorm(x, p[pre + "ffn_norm.weight"], cfg.norm_eps)
            g = F.silu(h2 @ p[pre + "feed_forward.w1.weight"].T) * \
                (h2 @ p[pre + "feed_forward.w3.weight"].T)
            x = x + g @ p[pre + "feed_forward.w2.weight"].T
        if last_only:
            x = x[:, -1]
        head = p["tok_embeddings.weight"] if cfg.tie_embeddings else p["output.weight"]
        return t_rmsnorm(x, p["norm.weight"], cfg.norm_eps) @ head.T

    def new_cache(self, B: int, S: int):
        t, cfg = self.torch, self.cfg
        shape = (B, S, cfg.n_kv_heads, cfg.head_dim)
        return ([t.zeros(shape, device=self.device) for _ in range(cfg.n_layers)],
                [t.zeros(shape, device=self.device) for _ in range(cfg.n_layers)])

    def make_optimizer(self, lr: float, beta1: float, beta2: float, eps: float, wd: float):
        """``torch.optim.AdamW`` over the parameters, the norms' gains without weight decay."""
        t = self.torch
        decay = [v for k, v in self.p.items() if not k.endswith("norm.weight")]
        no_decay = [v for k, v in self.p.items() if k.endswith("norm.weight")]
        return t.optim.AdamW([{"params": decay, "weight_decay": wd},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(beta1, beta2), eps=eps)

    def loss(self, tok, tgt, autocast: bool = False):
        """The mean cross-entropy of the next tokens ``tgt`` (-1: ignored); with ``autocast`` the
        forward runs under bf16 autocast (CUDA)."""
        F = self.torch.nn.functional
        with self.torch.autocast("cuda", dtype=self.torch.bfloat16, enabled=autocast):
            logits = self.forward(tok)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1),
                               ignore_index=-1)

    def grad_step(self, tok, tgt):
        """Forward and backward, every gradient left in its parameter's ``.grad`` (no update)."""
        for v in self.p.values():
            v.grad = None
        loss = self.loss(tok, tgt)
        loss.backward()
        return loss

    def train_step(self, opt, tok, tgt, autocast: bool = False):
        opt.zero_grad(set_to_none=True)
        loss = self.loss(tok, tgt, autocast)
        loss.backward()
        opt.step()
        return loss

    def decode(self, prompt: np.ndarray, n_new: int):
        t = self.torch
        with t.inference_mode():
            B, P = prompt.shape
            cache = self.new_cache(B, P + n_new)
            tok = t.tensor(prompt, device=self.device)
            nxt = self.forward(tok, 0, cache, last_only=True).argmax(-1)
            out = [nxt.cpu().numpy()]
            self.sync()
            t0 = time.perf_counter()
            for i in range(n_new - 1):
                nxt = self.forward(nxt[:, None], P + i, cache, last_only=True).argmax(-1)
                out.append(nxt.cpu().numpy())  # the ids cross to the host, as for minillama
            self.sync()
            return np.stack(out, axis=1), time.perf_counter() - t0

    def graph_decode(self, prompt: np.ndarray, n_new: int):
        """Greedy decode with a static KV cache and the whole step captured as one CUDA graph
        (token, position and output buffers on the device; attention over the full cache with
        a position mask): PyTorch's fastest plain decode. Returns (ids (B, n_new), seconds)."""
        t, cfg, p = self.torch, self.cfg, self.p
        F = t.nn.functional
        H, KVH, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        with t.inference_mode():
            B, P = prompt.shape
            S = P + n_new
            ck, cv = self.new_cache(B, S)
            nxt = self.forward(t.tensor(prompt, device=self.device), 0, (ck, cv),
                               last_only=True).argmax(-1)
            tok = nxt[:, None].clone()
            pos = t.full((B,), P, dtype=t.long, device=self.device)
            out = t.zeros((n_new, B), dtype=t.long, device=self.device)
            out[0] = nxt
            stepi = t.ones(1, dtype=t.long, device=self.device)
            ar_b = t.arange(B, device=self.device)
            ar_s = t.arange(S, device=self.device)
            head = p["tok_embeddings.weight"] if cfg.tie_embeddings else p["output.weight"]

            def rope(x, c, s_):
                x0, x1 = x[..., 0::2], x[..., 1::2]
                return t.stack((x0 * c - x1 * s_, x0 * s_ + x1 * c), dim=-1).flatten(-2)

            def step():
                x = F.embedding(tok, p["tok_embeddings.weight"])
                c = self.cos[pos][:, None, None, :]
                s_ = self.sin[pos][:, None, None, :]
                mask = (ar_s[None, :] <= pos[:, None])[:, None, None, :]
                for layer in range(cfg.n_layers):
                    pre = f"layers.{layer}."
                    h = t_rmsnorm(x, p[pre + "attention_norm.weight"], cfg.norm_eps)
                    q = rope((h @ p[pre + "attention.wq.weight"].T).view(B, 1, H, hd), c, s_)
                    k = rope((h @ p[pre + "attention.wk.weight"].T).view(B, 1, KVH, hd), c, s_)
                    v = (h @ p[pre + "attention.wv.weight"].T).view(B, 1, KVH, hd)
                    ck[layer][ar_b, pos] = k[:, 0]
                    cv[layer][ar_b, pos] = v[:, 0]
                    a = F.scaled_dot_product_attention(
                        q.transpose(1, 2), ck[layer].transpose(1, 2), cv[layer].transpose(1, 2),
                        attn_mask=mask, enable_gqa=(KVH != H))
                    x = x + (a.transpose(1, 2).reshape(B, 1, H * hd)
                             @ p[pre + "attention.wo.weight"].T)
                    h2 = t_rmsnorm(x, p[pre + "ffn_norm.weight"], cfg.norm_eps)
                    g = F.silu(h2 @ p[pre + "feed_forward.w1.weight"].T) * \
                        (h2 @ p[pre + "feed_forward.w3.weight"].T)
                    x = x + g @ p[pre + "feed_forward.w2.weight"].T
                nx = (t_rmsnorm(x[:, 0], p["norm.weight"], cfg.norm_eps) @ head.T).argmax(-1)
                out.index_copy_(0, stepi, nx[None])
                tok.copy_(nx[:, None])
                pos.add_(1)
                stepi.add_(1)

            saved = (tok.clone(), pos.clone(), stepi.clone())
            side = t.cuda.Stream()
            side.wait_stream(t.cuda.current_stream())
            with t.cuda.stream(side):
                for _ in range(2):
                    step()
                    tok.copy_(saved[0])
                    pos.copy_(saved[1])
                    stepi.copy_(saved[2])
            t.cuda.current_stream().wait_stream(side)
            graph = t.cuda.CUDAGraph()
            with t.cuda.graph(graph):
                step()
            tok.copy_(saved[0])
            pos.copy_(saved[1])
            stepi.copy_(saved[2])
            self.sync()
            t0 = time.perf_counter()
            for _ in range(n_new - 1):
                graph.replay()
            self.sync()
            dt = time.perf_counter() - t0
            return out.cpu().numpy().T.copy(), dt


def train_step_fns(cfg: ModelConfig, params: dict, tokens, targets, with_opt: bool):
    """``(step, step_opt)`` of :class:`TorchLlama` on the CPU for these tokens and next tokens,
    each returning the loss as a float: forward + backward (the gradients, no update), and the
    whole step with AdamW (lr 1e-4, betas (0.9, 0.95), eps 1e-8, weight decay 0.1; ``step_opt``
    needs ``with_opt``)."""
    peer = TorchLlama(cfg, params, "cpu")
    tok, tgt = torch.tensor(tokens), torch.tensor(targets)
    opt = peer.make_optimizer(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, wd=0.1) \
        if with_opt else None

    def step():
        return peer.grad_step(tok, tgt).item()

    def step_opt():
        return peer.train_step(opt, tok, tgt).item()

    return step, step_opt
