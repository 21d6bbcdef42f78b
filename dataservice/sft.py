"""Fine-tuning examples: a JSON record rendered into token ids and the runs of them the loss trains on.

Record kinds, one JSON Lines record each (`kind_of`):

    {"text": "..."}                                   a pretraining document: every token is a target
    {"prompt": "...", "completion": "..."}            loss on the completion and its end, not the prompt
    {"messages": [{"role": ..., "content": ...}, ...]} loss on each assistant turn and its end of turn

Targets are the tokens the model learns to produce: token t gets the label token[t] at position
t - 1 only when t is a target (`dataservice.packing.build_microbatch`).

With a chat template (the tokenizer folder's `chat_template.jinja`, or `chat_template` in its
`tokenizer_config.json`), a conversation is rendered by the template, as transformers renders it
(a sandboxed jinja2 environment). Assistant turn i covers the text that rendering
`messages[:i + 1]` adds to rendering `messages[:i]` with the generation prompt: its content and
whatever end of turn the template writes after it; that text must appear, in order, in the full
rendering, else the record is a `template_error`. A prompt/completion record is the conversation
[user: prompt, assistant: completion].

Without a template (the byte tokenizer, or `--chat-template plain`) the plain template is used;
a tokenizer.json without a template of its own is refused at the first fine-tuning record (the
build names the flags), never rendered with a template the model was not trained on:

    <|system|>\\n{content}\\n          system, user and tool turns: never targets
    <|user|>\\n{content}\\n
    <|assistant|>\\n{content}<eos>    the content and the eos token are targets

and a prompt/completion record is the prompt followed by the completion and eos (targets).

The pieces are tokenized one by one and concatenated, never the whole text at once: the prompt's
tokens are then exactly those a model sees at inference before it generates, and no token
straddles a target boundary.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import re
from dataclasses import dataclass
from typing import Any

import jinja2
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .tokenizer import Tokenizer

ROLES = ("system", "user", "assistant", "tool")
# Problems of fine-tuning records, counted by the build like its other problems.
EXAMPLE_PROBLEMS = ("no_assistant", "unknown_role", "empty_completion", "bad_example", "template_error")
PLAIN = "plain"


class ExampleProblem(Exception):
    """A record that cannot become a training example; `kind` is one of EXAMPLE_PROBLEMS."""

    def __init__(self, kind: str, detail: str = ""):
        super().__init__(detail or kind)
        self.kind = kind


@dataclass(frozen=True)
class Example:
    ids: np.ndarray  # token ids, the tokenizer's dtype
    target_runs: np.ndarray  # uint32 [runs, 2]: [start, end) token ranges that are targets, ascending


def kind_of(record: dict, text_field: str) -> str | None:
    """'messages', 'prompt_completion', 'text' or None (nothing usable), by which fields a record has."""
    if "messages" in record:
        return "messages"
    if "prompt" in record or "completion" in record:
        return "prompt_completion"
    if isinstance(record.get(text_field), str):
        return "text"
    return None


def _special(config: dict, name: str) -> str | None:
    value = config.get(name)
    if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message: str):
    raise ExampleProblem("template_error", str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    """A jinja2 chat template with the special-token strings it refers to."""

    def __init__(self, source: str, text: str, specials: dict[str, str]):
        self.source, self.text, self.specials = source, text, specials
        self.sha256 = hashlib.sha256(text.encode()).hexdigest()
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        # transformers' assistant-mask markers: the spans are found by incremental rendering here.
        body = re.sub(r"{%-?\s*(end)?generation\s*-?%}", "", text)
        try:
            self._template = env.from_string(body)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template {source} does not parse: {e}") from None

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.specials)
        except ExampleProblem:
            raise
        except Exception as e:  # a template may fail on any input it does not expect
            raise ExampleProblem("template_error", f"the chat template failed: {e}") from None

    def describe(self) -> dict:
        return {"kind": "template", "source": self.source, "sha256": self.sha256}


def find_chat_template(tokenizer_spec: str, choice: str = "auto") -> ChatTemplate | None:
    """The chat template a build uses: `choice` 'plain' gives None (the plain template), a path
    names a jinja file, 'auto' looks beside the tokenizer.json (chat_template.jinja, then
    tokenizer_config.json's chat_template) and falls back to the plain template.

    Raises ValueError for a template named but unusable."""
    if choice == PLAIN or (choice == "auto" and tokenizer_spec == "byte"):
        return None
    folder = None
    if tokenizer_spec != "byte":
        p = pathlib.Path(tokenizer_spec)
        folder = p if p.is_dir() else p.parent
    config = _read_json(folder / "tokenizer_config.json") if folder else {}
    specials = {f"{n}_token": v for n in ("bos", "eos", "pad", "unk") if (v := _special(config, f"{n}_token"))}
    if choice != "auto":
        path = pathlib.Path(choice)
        if not path.is_file():
            raise ValueError(f"--chat-template {choice!r} is not a file; give a jinja template file, 'auto' or 'plain'")
        return ChatTemplate(str(path), path.read_text(encoding="utf-8"), specials)
    if folder and (folder / "chat_template.jinja").is_file():
        path = folder / "chat_template.jinja"
        return ChatTemplate(str(path), path.read_text(encoding="utf-8"), specials)
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str) and template.strip():
        return ChatTemplate(str(folder / "tokenizer_config.json"), template, specials)
    return None


def _read_json(path: pathlib.Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    return data if isinstance(data, dict) else {}


def _check_utf8(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # JSON escapes can spell lone surrogates
        raise ExampleProblem("invalid_utf8") from None


def _messages(record: dict) -> list[dict]:
    """The record as a checked conversation; raises ExampleProblem."""
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ExampleProblem("bad_example", "'messages' must be a non-empty list")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ExampleProblem("bad_example", "each message needs a string 'role' and 'content'")
            if m["role"] not in ROLES:
                raise ExampleProblem("unknown_role", f"role {m['role']!r} (known: {', '.join(ROLES)})")
            _check_utf8(m["content"])
    else:
        prompt, completion = record.get("prompt"), record.get("completion")
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise ExampleProblem("bad_example", "'prompt' and 'completion' must both be strings")
        _check_utf8(prompt)
        _check_utf8(completion)
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
    assistants = [m for m in messages if m["role"] == "assistant"]
    if not assistants:
        raise ExampleProblem("no_assistant")
    if any(not m["content"].strip() for m in assistants):
        raise ExampleProblem("empty_completion")
    return messages


class NoChatTemplate(ValueError):
    """A fine-tuning record, and no template to render it: a build refuses to guess one."""


def missing_template(tokenizer_spec: str, choice: str, template: ChatTemplate | None) -> str | None:
    """Why fine-tuning records cannot be rendered, when `find_chat_template` found nothing for a
    tokenizer that should carry its own template ('auto' with a tokenizer.json); None when the
    plain template is what was asked for (or all the byte tokenizer has)."""
    if template is not None or choice != "auto" or tokenizer_spec == "byte":
        return None
    return (f"the tokenizer {tokenizer_spec} has no chat template (no chat_template.jinja beside it, no chat_template "
            "in its tokenizer_config.json); give --chat-template FILE (the model's jinja template) or "
            "--chat-template plain (the plain <|user|>/<|assistant|> template)")


class ExampleRenderer:
    """Turns fine-tuning records into Examples with one tokenizer and one template (None: plain).
    `refuse`: the reason a build has no template for them (NoChatTemplate at the first record)."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate | None, refuse: str | None = None):
        self.tok, self.template, self.refuse = tokenizer, template, refuse

    def describe(self) -> dict:
        return self.template.describe() if self.template else {"kind": PLAIN}

    def render(self, record: dict) -> Example:
        """Raises ExampleProblem for a record that cannot be used, NoChatTemplate without a template."""
        if self.refuse:
            raise NoChatTemplate(self.refuse)
        messages = _messages(record)
        if self.template is not None:
            pieces = self._template_pieces(messages)
        elif "messages" in record:
            pieces = self._plain_pieces(messages)
        else:
            pieces = [(record["prompt"], False), (record["completion"], True), (None, True)]
        return self._encode(pieces)

    def _plain_pieces(self, messages: list[dict]) -> list[tuple[str | None, bool]]:
        pieces: list[tuple[str | None, bool]] = []
        for m in messages:
            pieces.append((f"<|{m['role']}|>\n", False))
            if m["role"] == "assistant":
                pieces += [(m["content"], True), (None, True)]
            else:
                pieces.append((m["content"] + "\n", False))
        return pieces

    def _template_pieces(self, messages: list[dict]) -> list[tuple[str | None, bool]]:
        full = self.template.render(messages, add_generation_prompt=False)
        pieces: list[tuple[str | None, bool]] = []
        cursor = 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self.template.render(messages[:i], add_generation_prompt=True)
            through = self.template.render(messages[: i + 1], add_generation_prompt=False)
            if not through.startswith(before):
                raise ExampleProblem("template_error", "the template does not render a conversation incrementally")
            turn = through[len(before):]
            at = full.find(turn, cursor)
            if not turn or at < 0:
                raise ExampleProblem("template_error", "an assistant turn's text is not in the full rendering")
            pieces += [(full[cursor:at], False), (turn, True)]
            cursor = at + len(turn)
        pieces.append((full[cursor:], False))
        return pieces

    def _encode(self, pieces: list[tuple[str | None, bool]]) -> Example:
        eos = np.array([self.tok.eos_id], self.tok.dtype)
        arrays, runs, n = [], [], 0
        for text, target in pieces:
            if text == "":
                continue
            ids = eos if text is None else self.tok.encode(text)
            if target and ids.size:
                if runs and runs[-1][1] == n:
                    runs[-1][1] = n + ids.size
                else:
                    runs.append([n, n + ids.size])
            arrays.append(ids)
            n += ids.size
        return Example(np.concatenate(arrays).astype(self.tok.dtype, copy=False),
                       np.asarray(runs, np.uint32).reshape(-1, 2))


# What a build does with an example longer than --max-example-tokens (`fit_example`).
OVERLONG_MODES = ("drop", "split", "truncate-prompt")


def fit_example(example: Example, limit: int, mode: str) -> list[Example]:
    """`example` made to fit `limit` tokens: [] (dropped), or the Examples a build stores instead.

    drop: nothing. split: consecutive pieces of at most `limit` tokens, each with its own
    targets; a piece holding no target token is left out (it would train on nothing).
    truncate-prompt: the last `limit` tokens, so the final answer stays whole and the prompt
    loses its beginning (system text first); an earlier answer cut by the truncation is kept as
    context only, never trained on without its start; dropped when the final answer alone (from
    its first target token to the end) is longer than `limit`."""
    ids, runs = example.ids, example.target_runs.astype(np.int64)
    if mode == "drop":
        return []
    if mode == "split":
        pieces = []
        for start in range(0, ids.size, limit):
            stop = min(start + limit, ids.size)
            clipped = np.clip(runs, start, stop) - start
            clipped = clipped[clipped[:, 1] > clipped[:, 0]]
            if clipped.size:
                pieces.append(Example(ids[start:stop], clipped.astype(np.uint32)))
        return pieces
    if mode != "truncate-prompt":
        raise ValueError(f"over-long mode {mode!r}; expected one of {', '.join(OVERLONG_MODES)}")
    if ids.size - int(runs[-1, 0]) > limit:
        return []
    cut = ids.size - limit
    kept = runs[runs[:, 0] >= cut] - cut
    return [Example(ids[cut:], kept.astype(np.uint32))]


def target_mask(runs: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Bool mask of tokens [start, stop) of a document whose targets are `runs` ([k, 2] ranges)."""
    mask = np.zeros(stop - start, dtype=bool)
    for a, b in np.asarray(runs, np.int64).reshape(-1, 2).tolist():
        lo, hi = max(a, start), min(b, stop)
        if lo < hi:
            mask[lo - start:hi - start] = True
    return mask
