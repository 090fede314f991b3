"""Chat templates that turn a conversation into (prompt ids, response ids) pairs, LLaMA-Factory style.

Encoding is slot by slot and message by message (LLaMA-Factory's `data/template.py`): each string slot has `{{content}}`
substituted and is tokenised alone with `add_special_tokens=False` (empty strings skipped);
`{"bos_token"}` / `{"eos_token"}` / `{"token": t}` slots become single ids; the ids are
concatenated. This granularity matters: tokenising a whole rendered conversation can merge tokens
across slot boundaries and give different ids than LLaMA-Factory.

Templates: `qwen3` (ReasoningTemplate: thinking tags handled per `enable_thinking`), `qwen3_nothink`,
`chatml`, `llama3`, `empty`, `gpt` (= LLaMA-Factory's `gpt_oss`, harmony format, efficient eos); `template: null` renders each turn with the tokenizer's own Jinja
`chat_template` and splits the rendering at turn boundaries (see `HFChatTemplate`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

from meshforge.data.sft.converters import ASSISTANT, FUNCTION, OBSERVATION, USER

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Slot = str | dict[str, str] | set[str]

QWEN_TOOL_PROMPT = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tool_text}"
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    """<tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, """
    """"arguments": <args-json-object>}}\n</tool_call>"""
)


def qwen_tool_text(tools: list[dict[str, object]]) -> str:
    """The system-prompt tool block of the `qwen` tool format."""
    text = ""
    for tool in tools:
        wrapped = tool if tool.get("type") == "function" else {"type": "function", "function": tool}
        text += "\n" + json.dumps(wrapped, ensure_ascii=False)
    return QWEN_TOOL_PROMPT.format(tool_text=text)


def qwen_function_text(content: str) -> str:
    """A function-call message (JSON: one call or a list) as `<tool_call>` blocks."""
    try:
        calls = json.loads(content)
    except json.JSONDecodeError:
        raise ValueError(f"invalid JSON in a function-call message: {content[:80]!r}") from None
    calls = calls if isinstance(calls, list) else [calls]
    texts = [
        json.dumps({"name": call["name"], "arguments": call["arguments"]}, ensure_ascii=False)
        for call in calls
    ]
    return "\n".join(f"<tool_call>\n{text}\n</tool_call>" for text in texts)


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """`tokenizer.encode(text, add_special_tokens=False)`, straight through the Rust backend when possible.

    For a fast tokenizer that does not split special tokens the backend call gives the same ids
    (the LLaMA-Factory cross-check tests this) at a fraction of the cost: the transformers wrapper
    is about three quarters of the time of encoding one short slot.
    """
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "split_special_tokens", False):
        return backend.encode(text, add_special_tokens=False).ids
    return tokenizer.encode(text, add_special_tokens=False)


@dataclass
class Template:
    """A LLaMA-Factory template: slot lists per role plus the eos/stop-word rules."""

    name: str
    format_user: list[Slot] = field(default_factory=lambda: ["{{content}}"])
    format_assistant: list[Slot] = field(default_factory=lambda: ["{{content}}", {"eos_token"}])
    format_system: list[Slot] = field(default_factory=lambda: ["{{content}}"])
    format_function: list[Slot] | None = None
    format_observation: list[Slot] | None = None  # None: format_user
    format_prefix: list[Slot] = field(default_factory=list)
    default_system: str = ""
    stop_words: list[str] = field(default_factory=list)
    efficient_eos: bool = False
    replace_eos: bool = False
    tool_format: str | None = None
    thought_words: tuple[str, str] = ("<think>\n", "\n</think>\n\n")
    reasoning: bool = False
    enable_thinking: bool | None = True
    mask_history: bool = False

    # -- slot encoding -------------------------------------------------------------------------
    def _ids(self, tokenizer: PreTrainedTokenizerBase, slots: list[Slot], content: str = "") -> list[int]:
        ids: list[int] = []
        for slot in slots:
            if isinstance(slot, str):
                text = slot.replace("{{content}}", content)
                if text:
                    ids += encode_text(tokenizer, text)
            elif isinstance(slot, set):
                name = next(iter(slot))
                value = tokenizer.bos_token_id if name == "bos_token" else tokenizer.eos_token_id
                if value is not None:
                    ids.append(int(value))
            elif isinstance(slot, dict):
                # One token string converts to one id (a list only comes back for a list).
                ids.append(int(cast(int, tokenizer.convert_tokens_to_ids(slot["token"]))))
        return ids

    def _tools_text(self, tools: str) -> str:
        try:
            parsed = json.loads(tools)
        except json.JSONDecodeError:
            raise ValueError(f"tools must be a JSON list of function schemas, got {tools[:80]!r}") from None
        if not parsed:
            return ""
        if self.tool_format != "qwen":
            raise ValueError(
                f"template {self.name!r}: tools in the data need tool_format 'qwen' (the only tool format "
                f"built), got {self.tool_format!r}"
            )
        return qwen_tool_text(parsed)

    def _encode(
        self, tokenizer: PreTrainedTokenizerBase, messages: list[dict], system: str, tools: str
    ) -> list[list[int]]:
        system = system or self.default_system
        encoded = []
        for i, message in enumerate(messages):
            ids: list[int] = []
            if i == 0:
                ids += self._ids(tokenizer, self.format_prefix)
                if system or tools:
                    tool_text = self._tools_text(tools) if tools else ""
                    ids += self._ids(tokenizer, self.format_system, system + tool_text)
            role, content = message["role"], message["content"]
            if role == USER:
                ids += self._ids(tokenizer, self.format_user, content)
            elif role == ASSISTANT:
                ids += self._ids(tokenizer, self.format_assistant, content)
            elif role == OBSERVATION:
                ids += self._ids(tokenizer, self.format_observation or self.format_user, content)
            elif role == FUNCTION:
                ids += self._ids(tokenizer, self._function_slots(), self._function_content(content))
            else:
                raise ValueError(f"unexpected role {role!r} in a conversation")
            encoded.append(ids)
        return encoded

    def _function_slots(self) -> list[Slot]:
        return self.format_function or ["{{content}}", {"eos_token"}]

    def _function_content(self, content: str) -> str:
        if self.tool_format != "qwen":
            raise ValueError(f"template {self.name!r}: function-call turns need tool_format 'qwen'")
        open_, close = (w.strip() for w in self.thought_words)
        match = re.search(f"{re.escape(open_)}.*{re.escape(close)}\\s*", content, re.DOTALL)
        thought = match.group(0) if match else ""
        return thought + qwen_function_text(content.replace(thought, "") if thought else content)

    def remove_thought(self, content: str) -> str:
        """Drop each thought (the exact thought words around it, non-greedy), then leading newlines."""
        open_, close = self.thought_words
        return re.sub(f"{re.escape(open_)}(.*?){re.escape(close)}", "", content, flags=re.DOTALL).lstrip("\n")

    def encode_multiturn(
        self, tokenizer: PreTrainedTokenizerBase, messages: list[dict], system: str = "", tools: str = ""
    ) -> list[tuple[list[int], list[int]]]:
        """(prompt ids, response ids) per turn pair."""
        if not self.reasoning:
            encoded = self._encode(tokenizer, messages, system, tools)
            return [(encoded[i], encoded[i + 1]) for i in range(0, len(encoded), 2)]
        messages = [dict(m) for m in messages]
        last = len(messages) - 1
        for i in range(1, len(messages), 2):
            # enable_thinking False: no chain of thought anywhere; mask_history (LLaMA-Factory's
            # discarding_history_cot, preserve_thinking off): only the last answer keeps it.
            if self.enable_thinking is False or (self.mask_history and i != last):
                messages[i]["content"] = self.remove_thought(messages[i]["content"])
        encoded = self._encode(tokenizer, messages, system, tools)
        empty = encode_text(tokenizer, self.thought_words[0] + self.thought_words[1])
        open_, close = (w.strip() for w in self.thought_words)
        # Under mask_history only the (trained) last turn gets an empty thought, as in LLaMA-Factory.
        for i in [len(messages) - 2] if self.mask_history else range(0, len(messages), 2):
            content = messages[i + 1]["content"]
            if open_ not in content and close not in content:
                if self.enable_thinking:  # trained: the empty thought is part of the answer
                    encoded[i + 1] = empty + encoded[i + 1]
                else:  # False or None: part of the prompt, masked
                    encoded[i] = encoded[i] + empty
        return [(encoded[i], encoded[i + 1]) for i in range(0, len(encoded), 2)]

    def encode_oneturn(
        self, tokenizer: PreTrainedTokenizerBase, messages: list[dict], system: str = "", tools: str = ""
    ) -> tuple[list[int], list[int]]:
        """(prompt ids, last answer ids): the whole history is prompt (LLaMA-Factory's `encode_oneturn`).

        For reasoning templates LLaMA-Factory's one-turn rule (thoughts dropped from earlier
        answers, the empty thought only on the last one) is the multi-turn rule under
        `mask_history`, so this encodes with that switch on.
        """
        pairs = replace(self, mask_history=True).encode_multiturn(tokenizer, messages, system, tools)
        prompt = [t for source, target in pairs[:-1] for t in source + target] + pairs[-1][0]
        return prompt, pairs[-1][1]

    def fix_special_tokens(self, tokenizer: PreTrainedTokenizerBase) -> None:
        """LLaMA-Factory's eos/pad/stop-word fix, restricted to tokens already in the vocabulary.

        Raises:
            ValueError: a token the template needs is missing (adding it would need resized embeddings).
        """
        vocab = tokenizer.get_vocab()
        stop_words = list(self.stop_words)
        if self.replace_eos:
            _need(vocab, stop_words[0], self.name)
            tokenizer.eos_token = stop_words[0]
            stop_words = stop_words[1:]
        if tokenizer.eos_token_id is None:
            _need(vocab, "<|endoftext|>", self.name)
            tokenizer.eos_token = "<|endoftext|>"
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        for word in stop_words:
            _need(vocab, word, self.name)


def _need(vocab: dict[str, int], token: str, name: str) -> None:
    if token not in vocab:
        raise ValueError(
            f"train_dataset.template: {name!r} needs the token {token!r}, which the tokenizer lacks "
            "(adding tokens would need resized embeddings, which meshforge does not do yet)"
        )


_IM_USER = "<|im_start|>user\n{{content}}<|im_end|>\n<|im_start|>assistant\n"
_IM_ASSISTANT = "{{content}}<|im_end|>\n"
_IM_SYSTEM = "<|im_start|>system\n{{content}}<|im_end|>\n"
_QWEN3 = Template(
    "qwen3",
    format_user=[_IM_USER],
    format_assistant=[_IM_ASSISTANT],
    format_system=[_IM_SYSTEM],
    format_function=["{{content}}<|im_end|>\n"],
    format_observation=[
        "<|im_start|>user\n<tool_response>\n{{content}}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ],
    stop_words=["<|im_end|>"],
    replace_eos=True,
    tool_format="qwen",
    reasoning=True,
)
_H = "<|start_header_id|>{}<|end_header_id|>\n\n"
TEMPLATES: dict[str, Template] = {
    "qwen3": _QWEN3,
    "qwen3_nothink": replace(_QWEN3, name="qwen3_nothink", reasoning=False),
    "chatml": Template(
        "chatml",
        format_user=[_IM_USER],
        format_assistant=[_IM_ASSISTANT],
        format_system=[_IM_SYSTEM],
        format_observation=["<|im_start|>tool\n{{content}}<|im_end|>\n<|im_start|>assistant\n"],
        stop_words=["<|im_end|>", "<|im_start|>"],
        replace_eos=True,
    ),
    "llama3": Template(
        "llama3",
        format_user=[_H.format("user") + "{{content}}<|eot_id|>" + _H.format("assistant")],
        format_assistant=["{{content}}<|eot_id|>"],
        format_system=[_H.format("system") + "{{content}}<|eot_id|>"],
        format_observation=[_H.format("ipython") + "{{content}}<|eot_id|>" + _H.format("assistant")],
        format_prefix=[{"bos_token"}],
        stop_words=["<|eot_id|>", "<|eom_id|>"],
        replace_eos=True,
    ),
    "empty": Template("empty", format_assistant=["{{content}}"]),
    # gpt-oss "harmony" format (MindSpeed's `gpt`): the answer ends with the tokenizer's eos appended
    # once per example (efficient_eos), and the analysis channel plays the role of the thought.
    "gpt": Template(
        "gpt",
        format_user=["<|start|>user<|message|>{{content}}<|end|><|start|>assistant"],
        format_assistant=["{{content}}"],
        format_system=["<|start|>system<|message|>{{content}}<|end|>"],
        default_system="You are ChatGPT, a large language model trained by OpenAI.",
        thought_words=(
            "<|channel|>analysis<|message|>",
            "<|end|><|start|>assistant<|channel|>final<|message|>",
        ),
        efficient_eos=True,
        reasoning=True,
    ),
}
TEMPLATES["gpt_oss"] = replace(TEMPLATES["gpt"], name="gpt_oss")  # LLaMA-Factory's name for it


class HFChatTemplate(Template):
    """`template: null`: each turn as the tokenizer's own `chat_template` renders it.

    The conversation is rendered cumulatively; turn k's prompt is what rendering the first 2k+1
    messages with the generation prompt adds to the first 2k, its response what the first 2k+2 add
    to that. Each piece is tokenised alone, like a template slot. A template whose rendering of a
    longer conversation does not extend the shorter one cannot be split this way and is refused.
    """

    def encode_multiturn(
        self, tokenizer: PreTrainedTokenizerBase, messages: list[dict], system: str = "", tools: str = ""
    ) -> list[tuple[list[int], list[int]]]:
        system = system or self.default_system
        roles = {USER: "user", ASSISTANT: "assistant", OBSERVATION: "tool", FUNCTION: "assistant"}
        chat = ([{"role": "system", "content": system}] if system else []) + [
            {"role": roles[m["role"]], "content": m["content"]} for m in messages
        ]
        offset = 1 if system else 0
        kwargs: dict[str, Any] = {"tokenize": False}
        if tools:
            kwargs["tools"] = json.loads(tools)
        if self.enable_thinking is not None:
            kwargs["enable_thinking"] = bool(self.enable_thinking)

        def render(n: int, gen: bool) -> str:
            if n == 0:
                return ""
            # kwargs holds tokenize=False: the rendering is the text, not ids or an encoding.
            return cast(str, tokenizer.apply_chat_template(chat[:n], add_generation_prompt=gen, **kwargs))

        pairs = []
        before = ""
        for k in range(0, len(messages), 2):
            prompt_text = render(offset + k + 1, True)
            full = render(offset + k + 2, False)
            if not prompt_text.startswith(before) or not full.startswith(prompt_text):
                raise ValueError(
                    "train_dataset.template: null: the tokenizer's chat_template does not render a "
                    "conversation as an extension of its shorter prefixes; name a template instead"
                )
            pairs.append(
                (
                    self._text_ids(tokenizer, prompt_text[len(before) :]),
                    self._text_ids(tokenizer, full[len(prompt_text) :]),
                )
            )
            before = full
        return pairs

    @staticmethod
    def _text_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
        return encode_text(tokenizer, text) if text else []

    def fix_special_tokens(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token


def get_template(
    name: str | None,
    tokenizer: PreTrainedTokenizerBase,
    *,
    default_system: str | None = None,
    enable_thinking: bool | None = True,
    tool_format: str | None = None,
    mask_history: bool = False,
) -> Template:
    """The named template with the run's options applied, its special tokens fixed on `tokenizer`.

    Raises:
        ValueError: an unknown name (listing the built ones), or a tokenizer without what it needs.
    """
    if name is None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "train_dataset.template: null uses the tokenizer's chat_template, but it has none; "
                f"name one of {', '.join(TEMPLATES)}"
            )
        template: Template = HFChatTemplate("tokenizer", format_assistant=["{{content}}"])
    elif name in TEMPLATES:
        template = TEMPLATES[name]
    else:
        raise ValueError(
            f"train_dataset.template: unknown template {name!r} (built: {', '.join(TEMPLATES)}, or null)"
        )
    if tool_format is not None and tool_format != "qwen":
        raise ValueError(f"train_dataset.tool_format: {tool_format!r} is not built (built: qwen)")
    template = replace(
        template,
        default_system=default_system if default_system is not None else template.default_system,
        enable_thinking=enable_thinking,
        tool_format=tool_format or template.tool_format,
        mask_history=mask_history,
    )
    template.fix_special_tokens(tokenizer)
    return template
