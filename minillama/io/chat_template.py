r"""A model's own chat template and its end-of-turn tokens.

* :func:`render_chat` renders the template the model ships (GGUF ``tokenizer.chat_template``,
  Hugging Face ``chat_template.jinja`` or ``tokenizer_config.json``'s ``chat_template``) with
  jinja2 in an immutable sandbox, configured as transformers' ``apply_chat_template`` does:
  ``trim_blocks``, ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that
  keeps non-ASCII text, the globals ``raise_exception`` and ``strftime_now``, and the special
  tokens (``bos_token``, ``eos_token``...) as variables.
* :func:`stop_ids` is the set of ids that end a reply: EOS, the source's end-of-turn ids, and
  the families' end-of-turn spellings (:data:`STOP_NAMES`: ``<|im_end|>``, ``<|eot_id|>``,
  ``<|end_of_text|>``, ``<|endoftext|>``, ``<|eom_id|>``, ``<end_of_turn>``) where the vocabulary
  has them.
* :func:`encode_rendered` turns the rendered text into ids with special tokens spelled as such.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from minillama.core.errors import MinillamaError
from minillama.io.bpe import split_on
from minillama.io.families import stop_names

#: spellings of end-of-turn / end-of-text tokens: those of every family of
#: :data:`minillama.io.families.FAMILIES` (its ``stop_names``) and Gemma's ``<end_of_turn>``
STOP_NAMES = stop_names()


# ---------------------------------------------------------------------------------------------
# templates
# ---------------------------------------------------------------------------------------------
@lru_cache(maxsize=8)
def _compiled(template: str):
    try:
        import jinja2
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise MinillamaError("chat templates need the optional `jinja2` package: "
                             "pip install 'minillama[hf]'") from None
    import json

    class GenerationBlock(Extension):
        """``{% generation %}...{% endgeneration %}`` (marks assistant text for training
        masks in transformers): rendered as its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        import datetime

        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template), jinja2
    except jinja2.TemplateError as e:
        raise MinillamaError(f"chat template does not parse: {e}") from None


def special_tokens(tok) -> dict[str, str]:
    """The special tokens a template sees (``bos_token``, ``eos_token``, and ``unk_token`` /
    ``pad_token`` where the source names them), spelled as in the vocabulary."""
    names = dict(getattr(tok, "special_names", {}) or {})
    text = getattr(tok, "token_text", None)
    for key, i in (("bos_token", tok.bos_id), ("eos_token", tok.eos_id)):
        if key not in names and i is not None and text is not None:
            names[key] = text(i)
    return names


def render_chat(tok, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The conversation ``messages`` (``[{"role": ..., "content": ...}]``) rendered with the
    chat template of ``tok``'s source, as transformers'
    ``apply_chat_template(messages, tokenize=False, add_generation_prompt=...)`` renders it.
    A source without a template, or a template that fails, is one clear error."""
    template = getattr(tok, "chat_template", None)
    if not template:
        raise MinillamaError("the model has no chat template (GGUF tokenizer.chat_template, "
                             "chat_template.jinja or tokenizer_config.json chat_template)")
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise MinillamaError("messages must be a list of {'role': str, 'content': ...} objects")
    compiled, jinja2 = _compiled(template)
    kwargs = special_tokens(tok)
    try:
        return compiled.render(messages=messages, tools=None, documents=None,
                               add_generation_prompt=add_generation_prompt, **kwargs)
    except jinja2.TemplateError as e:
        raise MinillamaError(f"chat template: {e}") from None
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise MinillamaError(f"chat template failed on these messages: "
                             f"{type(e).__name__}: {str(e)[:100]}") from None


def stop_ids(tok) -> set[int]:
    """The token ids that end a reply: EOS, the source's own end-of-turn ids (GGUF
    ``eot_token_id``, ``generation_config.json``'s ``eos_token_id`` list...) and the common
    end-of-turn tokens (:data:`STOP_NAMES`) where the vocabulary has them."""
    out = {tok.eos_id} | set(getattr(tok, "stop_ids", ()) or ())
    lookup = getattr(tok, "token_id", None)
    if lookup is not None:
        out |= {lookup(name) for name in STOP_NAMES}
    out.discard(None)
    return {int(i) for i in out}


def encode_rendered(tok, text: str) -> list[int]:
    """The ids of a rendered conversation: special tokens written in the text (``<s>``,
    ``<|im_start|>``...) become their ids, and nothing is added (the template wrote BOS where
    the model wants it), as transformers tokenizes a rendered template. Tokenizers that do not
    split special tokens out of text themselves (SentencePiece from tokenizer.bin or GGUF) get
    the control pieces cut out here; each piece between them is encoded on its own."""
    if not hasattr(tok, "pieces"):  # HF and byte-level BPE tokenizers split added tokens
        return tok.encode(text, bos=False, eos=False)
    specials = {}
    for i in {tok.bos_id, tok.eos_id, *stop_ids(tok)} - {None}:
        name = tok.token_text(i)
        if name:
            specials[name] = i

    ids: list[int] = []
    for part, special in split_on(text, specials):
        ids += [specials[part]] if special else tok.encode(part, bos=False, eos=False)
    return ids


# ---------------------------------------------------------------------------------------------
# a conversation with its KV cache
# ---------------------------------------------------------------------------------------------
def common_prefix(a, b) -> int:
    """The length of the longest common prefix of two id sequences (lists or int arrays)."""
    m = min(len(a), len(b))
    if m == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:m]) != np.asarray(b[:m]))
    return int(diff[0]) if diff.size else m
