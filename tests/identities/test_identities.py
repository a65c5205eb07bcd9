"""``minillama check`` and the identities as a library (:mod:`minillama.identities`).

The command passes on every backend that can run here; broken ops planted in small backend
classes (this module, named on the command line as ``tests.identities.test_identities:Class``,
the way a user names their own backend) make it fail with exit status 1, a shrunk example and a
command line that reproduces it; ``check_attention`` / ``check_rope`` / ``check_norm`` catch a
user's broken function, README's example included; docs/MATH.md's Identities part is the catalog's.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from minillama.backends import get_backend
from minillama.backends.reference import ReferenceBackend
from minillama.cli.main import main
from minillama.core import ops
from minillama.identities import CATALOG, check_norm, check_rope, doc
from tests.support.helpers import BACKEND_PARAMS

ROOT = Path(__file__).resolve().parents[2]
#: this module as a user names a backend class of their own (``package.module:Class``)
SPEC = "tests.identities.test_identities"
MATH = ROOT / "docs" / "MATH.md"


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(["check", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def rows(out: str) -> dict[str, str]:
    """identity name -> its row of the table."""
    names = {i.name for i in CATALOG}
    return {line.split()[0]: line for line in out.splitlines()
            if line.split() and line.split()[0] in names}


# ---------------------------------------------------------------------------------------------
# the catalog passes on every backend
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", BACKEND_PARAMS)
def test_check_passes_on_every_backend(name, capsys):
    code, out, _ = run(capsys, "--backend", name, "--examples", "3", "--seed", "0")
    assert code == 0, out
    table = rows(out)
    assert set(table) == {i.name for i in CATALOG}
    backend = get_backend(name)  # a bitwise identity it does not promise: measured, not failed
    for ident in CATALOG:
        want = " pass " if ident.promised(backend) else " not guaranteed "
        assert want in table[ident.name], table[ident.name]
    kept = sum(ident.promised(backend) for ident in CATALOG)
    assert f"{len(CATALOG)} identities: {kept} passed, 0 failed, 0 skipped" in out


# ---------------------------------------------------------------------------------------------
# planted faults: a backend with one broken op (named as tests.identities.test_identities:Class)
# ---------------------------------------------------------------------------------------------
def _rope_one_sign_wrong(x, cos, sin):
    """y_2i = x_2i c + x_2i+1 s (should be minus): no longer a rotation."""
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    y = np.empty_like(x)
    y[..., 0::2] = x[..., 0::2] * c + x[..., 1::2] * s
    y[..., 1::2] = x[..., 0::2] * s + x[..., 1::2] * c
    return y, (cos, sin)


def _rmsnorm_mean_abs(x, g, eps):
    """Divides by mean |x| + eps instead of sqrt(mean x^2 + eps)."""
    return x / (np.abs(x).mean(-1, keepdims=True) + eps) * g, None


def _attention_wrong_group(q, k, v, start_pos=0):
    """Query head h reads KV head h % KVH instead of h // G."""
    idx = np.arange(q.shape[2]) % k.shape[2]
    return ops.attention_forward(q, k[:, :, idx], v[:, :, idx], start_pos)


def _cross_entropy_unshifted(logits, targets, ignore_index=-1):
    """log sum exp without the max subtracted: overflows for large logits."""
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        lse = np.log(np.exp(logits).sum(-1))
    return (lse - logits[np.arange(len(targets)), targets]).mean(), None


class NoMaskAttention(ReferenceBackend):
    """Attention without the causal mask: every query reads every key."""

    def attention_forward(self, q, k, v, start_pos=0):
        return ops.attention_forward(q, k, v, k.shape[1] - 1)


class StartPosIgnored(ReferenceBackend):
    """Attention that masks as if the queries started at position 0 (a broken KV cache)."""

    def attention_forward(self, q, k, v, start_pos=0):
        return ops.attention_forward(q, k, v, 0)


class WrongSignRope(ReferenceBackend):
    rope_forward = staticmethod(_rope_one_sign_wrong)


class NoEpsRMSNorm(ReferenceBackend):
    """RMSNorm without its epsilon."""

    def rmsnorm_forward(self, x, g, eps):
        return ops.rmsnorm_forward(x, g, 0.0)


class MeanAbsRMSNorm(ReferenceBackend):
    rmsnorm_forward = staticmethod(_rmsnorm_mean_abs)


class WrongGroupAttention(ReferenceBackend):
    attention_forward = staticmethod(_attention_wrong_group)


class UnshiftedCrossEntropy(ReferenceBackend):
    cross_entropy_forward = staticmethod(_cross_entropy_unshifted)


class UnscaledLoRA(ReferenceBackend):
    """The adapter's product without its scale s."""

    def lora_forward(self, x, w, a, b, scale, drop=None):
        return ops.lora_forward(x, w, a, b, 1.0, drop)


# realistic one-op faults the invariances let through: a wrong backward, a wrong scale, ignored
# targets counted, a cached chunk masked as a fresh prefill
class RMSNormBackwardNoMeanTerm(ReferenceBackend):
    """dx = r (dy g): the term through the shared 1/rms forgotten."""

    def rmsnorm_backward(self, dy, ctx):
        x, r, g = ctx
        return r * dy * g, (dy * x * r).reshape(-1, x.shape[-1]).sum(axis=0)


class AttentionBackwardUnscaledQ(ReferenceBackend):
    """dq without the 1/sqrt(hd) of the scores."""

    def attention_backward(self, dout, ctx):
        dq, dk, dv = ops.attention_backward(dout, ctx)
        return dq * np.sqrt(dout.shape[-1]), dk, dv


class SwiGLUBackwardSigmoidOnly(ReferenceBackend):
    """da = dh b sigma(a): silu's derivative taken as the sigmoid's value."""

    def swiglu_backward(self, dh, ctx):
        a, b, sig, silu = ctx
        return dh * b * sig, dh * silu


class LoRABackwardUnscaledB(ReferenceBackend):
    """dB = dy^T u without the adapter's scale s."""

    def lora_backward(self, dy, ctx):
        dx, da, db = ops.lora_backward(dy, ctx)
        return dx, da, db / ctx[4]


class CrossEntropyBackwardAllRows(ReferenceBackend):
    """The gradient of the mean over all N rows (ignored ones included) instead of the kept."""

    def cross_entropy_backward(self, dloss, ctx):
        p, t, valid, count = ctx
        dz = p.copy()
        dz[np.arange(p.shape[0]), t] -= 1.0
        return dz * (np.asarray(dloss) / p.shape[0])


class AttentionScaledByHd(ReferenceBackend):
    """Scores q.k / hd instead of q.k / sqrt(hd) (and the matching backward)."""

    def attention_forward(self, q, k, v, start_pos=0):
        return ops.attention_forward(q / np.sqrt(q.shape[-1]), k, v, start_pos)


class IgnoredTargetsCounted(ReferenceBackend):
    """The mean loss over all rows: an ignored target (-1) reads the last logit as Python's
    negative index does."""

    def cross_entropy_forward(self, logits, targets, ignore_index=-1):
        p = ops.softmax(logits)
        rows = np.arange(len(targets))
        return -np.log(p[rows, targets]).mean(), None


class HeadIgnoresIgnoreIndex(ReferenceBackend):
    """The loss head's logits, then a cross-entropy that never looks at the ignore index."""

    def linear_cross_entropy_forward(self, x, w, targets, ignore_index=-1):
        return IgnoredTargetsCounted.cross_entropy_forward(self, x @ w.T, targets)


class ChunkMaskedAsPrefill(ReferenceBackend):
    """A prefill path for T > 1 that masks as if no positions were cached (a decode step,
    T = 1, keeps start_pos): a chunk after a cached prefix reads the wrong keys."""

    def attention_forward(self, q, k, v, start_pos=0):
        return ops.attention_forward(q, k, v, 0 if q.shape[1] > 1 else start_pos)


PLANTED = [("NoMaskAttention", "attention_causal_mask"),
           ("NoMaskAttention", "model_causality"),
           ("StartPosIgnored", "attention_cached_rows"),
           ("StartPosIgnored", "model_kv_cache_decode"),
           ("WrongSignRope", "rope_preserves_pair_norms"),
           ("WrongSignRope", "rope_relative_position"),
           ("NoEpsRMSNorm", "rmsnorm_unit_gain_rms"),
           ("MeanAbsRMSNorm", "rmsnorm_unit_gain_rms"),
           ("WrongGroupAttention", "attention_gqa_equals_repeated_mha"),
           ("UnshiftedCrossEntropy", "cross_entropy_shift_invariance"),
           ("UnscaledLoRA", "lora_merge_equivalence"),
           ("RMSNormBackwardNoMeanTerm", "rmsnorm_gradient"),
           ("AttentionBackwardUnscaledQ", "attention_gradient"),
           ("SwiGLUBackwardSigmoidOnly", "swiglu_gradient"),
           ("LoRABackwardUnscaledB", "lora_gradient"),
           ("CrossEntropyBackwardAllRows", "cross_entropy_gradient"),
           ("AttentionScaledByHd", "attention_two_keys_closed_form"),
           ("AttentionScaledByHd", "attention_zero_padding_rescales"),
           ("IgnoredTargetsCounted", "cross_entropy_known_values"),
           ("HeadIgnoresIgnoreIndex", "linear_cross_entropy_known_values"),
           ("ChunkMaskedAsPrefill", "attention_cached_rows"),
           ("ChunkMaskedAsPrefill", "model_kv_cache_decode")]


def _shrunk(out: str) -> dict:
    m = re.search(r"shrunk example: (\{.*\})", out)
    assert m, out
    return ast.literal_eval(m.group(1))


@pytest.mark.parametrize(("cls", "identity"), PLANTED, ids=[f"{c}-{i}" for c, i in PLANTED])
def test_planted_fault_fails_with_a_shrunk_reproducible_example(cls, identity, capsys):
    spec = f"{SPEC}:{cls}"
    code, out, err = run(capsys, "--backend", spec, "--only", identity, "--seed", "0",
                         "--examples", "30")
    assert code == 1, out + err
    assert re.search(rf"^{identity}\s+\d+\s+\S+\s+FAIL\s", out, re.M), out
    assert f"FAILED {identity}" in out
    example = _shrunk(out)
    env, line = re.search(r"reproduce: (PYTHONPATH=\S+ )?(minillama check .*)$", out,
                          re.M).groups()
    assert env == f"PYTHONPATH={ROOT} "  # the folder of the user's package, to run from anywhere
    assert f"--backend {spec} --only {identity} --seed 0" in line
    # the printed command reproduces the same shrunk example
    code2, out2, _ = run(capsys, *shlex.split(line)[2:])
    assert code2 == 1 and _shrunk(out2) == example


@pytest.mark.parametrize(("cls", "blind"), [
    ("RMSNormBackwardNoMeanTerm", ["model_batch_gradient_is_mean"]),
    ("AttentionScaledByHd", ["attention_causal_mask", "attention_cached_rows",
                             "attention_gqa_equals_repeated_mha", "attention_key_shift_invariance",
                             "attention_head_permutation", "attention_batch_independence",
                             "model_causality", "model_kv_cache_decode",
                             "model_batch_independence"]),
])
def test_the_invariances_alone_let_these_faults_through(cls, blind, capsys):
    """What the gradient and known-answer identities add: the faults above pass the invariances
    of their op (linear in the gradient, or blind to the score scale; only the comparison with
    the reference's cross-attention, another op, saw the scale before)."""
    code, out, _ = run(capsys, "--backend", f"{SPEC}:{cls}", "--only", *blind,
                       "--seed", "0", "--examples", "20")
    assert code == 0, out
    assert f"{len(blind)} passed, 0 failed" in out


def test_a_shrunk_example_is_the_smallest_the_strategy_allows(capsys):
    """No mask fails on any example: hypothesis shrinks to one sequence of two queries, one
    head of the smallest size and seed 0."""
    code, out, _ = run(capsys, "--backend", f"{SPEC}:NoMaskAttention", "--only",
                       "attention_causal_mask", "--seed", "5")
    assert code == 1
    ex = _shrunk(out)
    assert (ex["seed"], ex["B"], ex["T"], ex["extra"], ex["KVH"], ex["G"], ex["hd"],
            ex["t0"]) == (0, 1, 2, 0, 1, 1, 2, 0)


# ---------------------------------------------------------------------------------------------
# the command's options
# ---------------------------------------------------------------------------------------------
def test_json_reports_every_identity_and_the_failure(capsys):
    names = ["attention_causal_mask", "attention_gqa_equals_repeated_mha", "quant_round_trip"]
    code, out, _ = run(capsys, "--backend", f"{SPEC}:NoMaskAttention", "--only", *names,
                       "--seed", "1", "--examples", "10", "--json")
    assert code == 1
    report = json.loads(out)
    assert report["passed"] is False and report["seed"] == 1 and report["dtype"] == "float64"
    by_name = {r["name"]: r for r in report["results"]}
    assert list(by_name) == names
    bad = by_name["attention_causal_mask"]
    assert bad["status"] == "fail" and bad["counterexample"]["T"] >= 2
    assert bad["reproduce"].startswith(f"PYTHONPATH={ROOT} minillama check --backend "
                                       f"{SPEC}:NoMaskAttention")
    for name in names[1:]:
        assert by_name[name]["status"] == "pass" and by_name[name]["examples"] >= 1
        assert 0 <= by_name[name]["worst"] <= 1


def test_only_runs_the_identities_named(capsys):
    code, out, _ = run(capsys, "--only", "lora_merge_equivalence", "rope_relative_position",
                       "--examples", "5")
    assert code == 0
    assert set(rows(out)) == {"lora_merge_equivalence", "rope_relative_position"}
    assert "2 identities: 2 passed" in out


class BareRowOps:
    """A user's backend of two NumPy ops and no helpers (no xp, asarray, to_numpy)."""

    def rope_forward(self, x, cos, sin):
        return ops.rope_forward(x, cos, sin)

    def rmsnorm_forward(self, x, g, eps):
        r = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
        return x * r * g, None


def test_a_user_backend_class_runs_its_ops_and_skips_the_rest(capsys):
    """A bare class of two forwards: every identity that calls one of them runs (a model
    identity with the reference's other ops, said in its row); those that touch none of them,
    core code included, are skipped and not counted as passed."""
    code, out, _ = run(capsys, "--backend", f"{SPEC}:BareRowOps", "--only",
                       "rope_relative_position", "rmsnorm_scale_invariance",
                       "attention_causal_mask", "model_causality", "quant_round_trip",
                       "--examples", "5", "--seed", "2")
    assert code == 0, out
    table = rows(out)
    for name in ("rope_relative_position", "rmsnorm_scale_invariance", "model_causality"):
        assert " pass " in table[name]
    assert "(reference's embedding_forward, linear_forward, attention_forward" in \
        table["model_causality"]
    assert "reference's" not in table["rope_relative_position"]
    assert "skip (no attention_forward)" in table["attention_causal_mask"]
    assert "skip (core code only" in table["quant_round_trip"]
    assert "3 passed, 0 failed, 2 skipped; 1 ran with some of the reference's ops" in out


class ForwardOnlyRMSNorm:
    """A user's RMSNorm forward whose saved context is not the reference's."""

    def rmsnorm_forward(self, x, g, eps):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g, "mine"


class WrongBackwardRMSNorm(ForwardOnlyRMSNorm):
    def rmsnorm_backward(self, dy, ctx):
        return dy, dy.reshape(-1, dy.shape[-1]).sum(axis=0)


def test_a_forward_without_its_backward_gets_the_references_backward(capsys):
    """The reference's backward is lent on the reference's context of the same arguments: the
    gradient identity then holds the user's forward to the reference's derivative."""
    names = ("rmsnorm_gradient", "model_batch_gradient_is_mean")
    code, out, _ = run(capsys, "--backend", f"{SPEC}:ForwardOnlyRMSNorm", "--only",
                       *names, "--examples", "10", "--seed", "3")
    assert code == 0, out
    assert "(reference's rmsnorm_backward)" in rows(out)["rmsnorm_gradient"]
    code, out, _ = run(capsys, "--backend", f"{SPEC}:WrongBackwardRMSNorm", "--only",
                       *names, "--examples", "10", "--seed", "3")
    assert code == 1
    assert " FAIL " in rows(out)["rmsnorm_gradient"]
    assert "reference's" not in rows(out)["rmsnorm_gradient"]


class LinearWithOwnContext:
    """A user's linear forward and backward with a context of its own, and no
    linear_backward_input (the reference lends it)."""

    def linear_forward(self, x, w):  # W a float matrix or GGML blocks
        return ops.linear_forward(x, w)[0], ("mine", x, w)

    def linear_backward(self, dy, ctx):
        _, x, w = ctx
        return dy @ w, dy.reshape(-1, dy.shape[-1]).T @ x.reshape(-1, x.shape[-1])


def test_a_lent_backward_beside_the_users_own_backward_of_one_forward(capsys):
    """linear_forward feeds the user's linear_backward (its own context) and the reference's
    lent linear_backward_input (the reference's context of the same arguments) alike."""
    code, out, _ = run(capsys, "--backend", f"{SPEC}:LinearWithOwnContext", "--only",
                       "linear_gradient", "linear_backward_input_gradient", "--examples", "5",
                       "--seed", "5")
    assert code == 0, out
    table = rows(out)
    assert " pass " in table["linear_gradient"] and "reference's" not in table["linear_gradient"]
    assert " pass " in table["linear_backward_input_gradient"]


def test_the_reproduce_line_runs_from_another_folder(capsys, tmp_path):
    code, out, _ = run(capsys, "--backend", f"{SPEC}:WrongBackwardRMSNorm", "--only",
                       "rmsnorm_gradient", "--examples", "5", "--seed", "4")
    assert code == 1
    line = re.search(r"reproduce: (.*)$", out, re.M).group(1)
    assert line.startswith(f"PYTHONPATH={ROOT} minillama check ")
    env, argv = line.split(" ", 1)
    argv = shlex.split(argv)
    argv[0:1] = [sys.executable, "-m", "minillama"]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, env.split("=", 1)[0]: env.split("=", 1)[1]})
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAILED rmsnorm_gradient" in done.stdout and _shrunk(done.stdout) == _shrunk(out)


@pytest.mark.parametrize(("spec", "hint"), [
    ("mybackend.py:Mine", "(e.g. mybackend:Mine)"),
    ("some/folder/mybackend.py:Mine", "(e.g. PYTHONPATH=some/folder minillama check --backend "
                                      "mybackend:Mine)"),
    ("mybackend", "named as module:Class (e.g. mybackend:Class)"),
    ("numpi", "(did you mean numpy?)"),
])
def test_a_file_or_bare_module_as_backend_gets_a_hint(spec, hint, capsys):
    code, out, err = run(capsys, "--backend", spec)
    assert code == 2 and out == ""
    assert err.startswith("minillama: error: ") and hint in err, err


def test_a_misspelled_identity_names_the_close_matches(capsys):
    code, _, err = run(capsys, "--only", "rmsnorm_gradeint")
    assert code == 2
    assert "did you mean rmsnorm_gradient" in err
    assert "attention_causal_mask" not in err  # not the whole catalog


@pytest.mark.parametrize("argv", [
    ("--only", "no_such_identity"),
    ("--backend", "no_such_module_xyz:Backend"),
    ("--backend", f"{SPEC}:NoSuchClass"),
    ("--backend", "no_such_backend"),
    ("--backend", "tests/identities/test_identities.py:NoMaskAttention"),
    ("--seed", "-1"),
])
def test_bad_input_is_one_error_line_and_status_2(argv, capsys):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("minillama: error: "), err


def test_list_names_every_identity(capsys):
    code, out, _ = run(capsys, "--list")
    assert code == 0
    assert [line.split()[0] for line in out.splitlines()] == [i.name for i in CATALOG]


# ---------------------------------------------------------------------------------------------
# the identities as a library for a user's function
# ---------------------------------------------------------------------------------------------
def _readme_example() -> str:
    """README's example, read from README.md (the python block that calls check_attention)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    (code,) = [b for b in blocks if "check_attention(my_attention)" in b]
    return code


README_EXAMPLE = _readme_example()


def test_readme_example_catches_the_missing_mask():
    with pytest.raises(AssertionError) as e:
        exec(compile(README_EXAMPLE, "README.md", "exec"), {})
    text = str(e.value)
    assert "FAILED attention_causal_mask" in text and "shrunk example: {" in text
    assert "check_attention(fn, seed=" in text
    assert "FAILED attention_gqa_equals_repeated_mha" not in text  # only the mask is wrong


def test_readme_example_with_the_mask_passes():
    fixed = README_EXAMPLE.replace("    # forgot: s = ", "    s = ").replace(
        "    #                      s, -np.inf)", "                 s, -np.inf)")
    assert fixed != README_EXAMPLE
    exec(compile(fixed, "README.md", "exec"), {})


def test_check_rope_takes_either_pair_layout():
    def half_split(x, positions):
        hd = x.shape[-1]
        inv = 10000.0 ** (-np.arange(0, hd, 2) / hd)
        ang = np.asarray(positions, dtype=np.float64)[:, None] * inv  # (T, hd/2)
        c, s = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
        a, b = x[..., :hd // 2], x[..., hd // 2:]
        return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)

    results = check_rope(half_split, layout="half", examples=20, seed=0)
    assert {r.name for r in results} >= {"rope_relative_position", "rope_preserves_pair_norms"}
    with pytest.raises(AssertionError, match="rope_preserves_pair_norms"):
        check_rope(half_split, layout="interleaved", examples=20, seed=0)


def _interleaved_rope(theta):
    def rope(x, positions):
        hd = x.shape[-1]
        ang = np.asarray(positions, dtype=np.float64)[:, None] * theta ** (
            -np.arange(0, hd, 2) / hd)
        c, s = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
        y = np.empty_like(x)
        y[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * s
        y[..., 1::2] = x[..., 0::2] * s + x[..., 1::2] * c
        return y

    return rope


def test_check_rope_holds_a_function_to_its_base():
    """Every invariance of RoPE holds for any base: only the known angles see a function that
    uses LLaMA 2's 10000 where Llama 3's 500000 was meant."""
    results = check_rope(_interleaved_rope(500000.0), theta=500000.0, examples=20, seed=0)
    assert "rope_angles_known" in {r.name for r in results}
    with pytest.raises(AssertionError) as e:
        check_rope(_interleaved_rope(10000.0), theta=500000.0, examples=20, seed=0)
    text = str(e.value)
    assert "FAILED rope_angles_known" in text and "check_rope(fn, theta=500000.0" in text
    assert "FAILED rope_relative_position" not in text


def test_check_norm_catches_a_norm_without_epsilon():
    def rmsnorm(x, g, eps):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g

    assert all(r.status == "pass" for r in check_norm(rmsnorm, examples=20, seed=0))
    with pytest.raises(AssertionError, match="FAILED rmsnorm_unit_gain_rms"):
        check_norm(lambda x, g, eps: rmsnorm(x, g, 0.0), examples=20, seed=0)

    def layernorm(x, g, b, eps):
        xc = x - x.mean(-1, keepdims=True)
        return xc / np.sqrt((xc * xc).mean(-1, keepdims=True) + eps) * g + b

    names = {r.name for r in check_norm(layernorm, kind="layernorm", examples=20, seed=0)}
    assert names == {"layernorm_shift_scale_invariance", "layernorm_rows_independent"}


def test_identity_check_takes_a_backend_and_an_example():
    from minillama.identities import BY_NAME

    ident = BY_NAME["attention_causal_mask"]
    example = {"seed": 3, "B": 1, "T": 3, "extra": 1, "KVH": 1, "G": 2, "hd": 4, "t0": 1}
    assert ident.check(ReferenceBackend(), example) <= 1
    assert ident.check(NoMaskAttention(), example) > 1
    assert ident.missing(BareRowOps()) == ["attention_forward"]


# ---------------------------------------------------------------------------------------------
# docs and layers
# ---------------------------------------------------------------------------------------------
def test_math_md_identities_part_is_the_catalog():
    part = doc.section(MATH.read_text(encoding="utf-8"))
    assert part is not None, f"{MATH} has no '{doc.HEADING}'"
    named = re.findall(r"^\*\*`(\w+)`\*\*", part, re.M)
    assert sorted(named) == sorted(i.name for i in CATALOG), "names differ from the catalog"
    for ident in CATALOG:
        entry = re.search(rf"^\*\*`{ident.name}`\*\* \([^)]*\)+\. (.*)$", part, re.M)
        assert entry and entry.group(1) == ident.statement, ident.name
    assert part == doc.markdown(), ("docs/MATH.md's Identities part differs from the catalog: "
                                    "python -m minillama.identities.doc docs/MATH.md")


def test_the_package_root_does_not_import_the_identities():
    code = ("import sys, minillama; "
            "assert 'minillama.identities' not in sys.modules, 'imported'; "
            "assert 'hypothesis' not in sys.modules, 'hypothesis imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_readme_counts_the_catalog():
    """README's count of the identities is the catalog's."""
    from pathlib import Path

    from minillama.identities.catalog import CATALOG

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    counts = {int(n) for n in re.findall(r"(\d+) identities", readme)}
    assert counts == {len(CATALOG)}, counts
