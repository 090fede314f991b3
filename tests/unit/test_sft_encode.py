"""SFT encoding against LLaMA-Factory's template rules, with expectations written from the rules.

Every expected id list is built from the strings the rules say each slot renders, each tokenised on
its own (the slot granularity), so a template or processor that renders differently fails here.
"""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from meshforge.data.sft.converters import convert_alpaca, convert_batch, convert_sharegpt  # noqa: E402
from meshforge.data.sft.dataset_info import COLUMN_DEFAULTS, TAG_DEFAULTS, resolve_datasets  # noqa: E402
from meshforge.data.sft.packing import greedy_knapsack, pack_examples  # noqa: E402
from meshforge.data.sft.processor import IGNORE_INDEX as X  # noqa: E402
from meshforge.data.sft.processor import encode_example, infer_seqlen  # noqa: E402
from meshforge.data.sft.templates import get_template, qwen_tool_text  # noqa: E402
from meshforge.data.tokenizer import build_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("meshforge://assets/tokenizer")


def enc(tok, *texts: str) -> list[int]:
    return [i for t in texts for i in tok.encode(t, add_special_tokens=False)]


def U(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def A(text: str) -> str:
    return f"{text}<|im_end|>\n"


def S(text: str) -> str:
    return f"<|im_start|>system\n{text}<|im_end|>\n"


def encode(tok, template, example, cutoff=1024, train_on_prompt=False, mask_history=False):
    return encode_example(
        template,
        tok,
        example["_prompt"],
        example["_response"],
        example["_system"],
        example["_tools"],
        cutoff_len=cutoff,
        train_on_prompt=train_on_prompt,
        mask_history=mask_history,
    )


ALPACA = {
    "instruction": "Add the numbers.",
    "input": "2 and 3",
    "output": "5",
    "history": [["Hi", "Hello!"]],
    "system": "Be exact.",
}


def test_alpaca_with_history_and_system(tok):
    columns = {**COLUMN_DEFAULTS, "history": "history", "system": "system"}
    ex = convert_alpaca(ALPACA, columns)
    assert ex["_error"] == ""
    assert [m["content"] for m in ex["_prompt"]] == ["Hi", "Hello!", "Add the numbers.\n2 and 3"]
    template = get_template("qwen3_nothink", tok)
    ids, labels = encode(tok, template, ex)
    p1, r1 = enc(tok, S("Be exact."), U("Hi")), enc(tok, A("Hello!"))
    p2, r2 = enc(tok, U("Add the numbers.\n2 and 3")), enc(tok, A("5"))
    assert ids == p1 + r1 + p2 + r2
    assert labels == [X] * len(p1) + r1 + [X] * len(p2) + r2
    # train_on_prompt keeps the prompt tokens as labels; mask_history trains only the last answer.
    assert encode(tok, template, ex, train_on_prompt=True)[1] == ids
    assert encode(tok, template, ex, mask_history=True) == (ids, [X] * (len(ids) - len(r2)) + r2)


SHAREGPT = {
    "conversations": [
        {"from": "system", "value": "You are a calculator."},
        {"from": "human", "value": "What is 2+2?"},
        {"from": "function_call", "value": json.dumps({"name": "add", "arguments": {"a": 2, "b": 2}})},
        {"from": "observation", "value": "4"},
        {"from": "gpt", "value": "It is 4."},
    ],
    "tools": json.dumps([{"name": "add", "description": "Add", "parameters": {"type": "object"}}]),
}


def test_sharegpt_multiturn_with_system_and_tools(tok):
    ex = convert_sharegpt(SHAREGPT, {**COLUMN_DEFAULTS, "tools": "tools"}, TAG_DEFAULTS)
    assert ex["_error"] == "" and ex["_system"] == "You are a calculator."
    template = get_template("qwen3_nothink", tok)
    ids, labels = encode(tok, template, ex)
    tool_text = (
        "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "add", "description": "Add", "parameters": {"type": "object"}}}'
        "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
        "\n</tool_call>"
    )
    assert qwen_tool_text(json.loads(SHAREGPT["tools"])) == tool_text
    p1 = enc(tok, S("You are a calculator." + tool_text), U("What is 2+2?"))
    r1 = enc(tok, '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call><|im_end|>\n')
    p2 = enc(tok, "<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    r2 = enc(tok, A("It is 4."))
    assert ids == p1 + r1 + p2 + r2
    assert labels == [X] * len(p1) + r1 + [X] * len(p2) + r2


THINK = "<think>\nadd them\n</think>\n\n"


@pytest.mark.parametrize("enable_thinking", [True, False, None])
def test_qwen3_thinking_tags(tok, enable_thinking):
    template = get_template("qwen3", tok, enable_thinking=enable_thinking)
    ex = {
        "_prompt": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": THINK + "b"},
            {"role": "user", "content": "c"},
        ],
        "_response": [{"role": "assistant", "content": "d"}],
        "_system": "",
        "_tools": "",
    }
    ids, labels = encode(tok, template, ex)
    empty = enc(tok, "<think>\n\n</think>\n\n")
    p1, p2 = enc(tok, U("a")), enc(tok, U("c"))
    if enable_thinking:  # turn 1 keeps its thought; turn 2 gets the empty thought, trained
        r1, r2 = enc(tok, A(THINK + "b")), empty + enc(tok, A("d"))
    elif enable_thinking is False:  # thoughts removed; empty thoughts go to the prompts, masked
        p1, r1, p2, r2 = p1 + empty, enc(tok, A("b")), p2 + empty, enc(tok, A("d"))
    else:  # None: data kept as is; the empty thought of turn 2 is masked
        r1, p2, r2 = enc(tok, A(THINK + "b")), p2 + empty, enc(tok, A("d"))
    assert ids == p1 + r1 + p2 + r2
    assert labels == [X] * len(p1) + r1 + [X] * len(p2) + r2


def test_qwen3_mask_history_drops_old_thoughts(tok):
    template = get_template("qwen3", tok, mask_history=True)
    ex = {
        "_prompt": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": THINK + "b"},
            {"role": "user", "content": "c"},
        ],
        "_response": [{"role": "assistant", "content": THINK + "d"}],
        "_system": "",
        "_tools": "",
    }
    ids, labels = encode(tok, template, ex, mask_history=True)
    # The old thought is removed and, unlike without mask_history, no empty thought replaces it.
    first = enc(tok, U("a")) + enc(tok, A("b"))
    last_p, last_r = enc(tok, U("c")), enc(tok, A(THINK + "d"))
    assert ids == first + last_p + last_r
    assert labels == [X] * (len(first) + len(last_p)) + last_r


@pytest.mark.parametrize(
    "src,tgt,cutoff,expected",
    [(10, 20, 100, (10, 20)), (10, 80, 100, (10, 80)), (80, 60, 100, (58, 42)), (30, 200, 100, (30, 70))],
)
def test_infer_seqlen(src, tgt, cutoff, expected):
    # (10, 80): short prompt kept, target gets the rest (90, so all 80); (80, 60): both long, target
    # int(100*60/140) = 42 and the prompt the remaining 58; (30, 200): target 100-30 = 70.
    assert infer_seqlen(src, tgt, cutoff) == expected


def test_truncation_follows_infer_seqlen(tok):
    template = get_template("qwen3_nothink", tok)
    long_q, long_a = "word " * 60, "answer " * 60
    ex = {
        "_prompt": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"},
            {"role": "user", "content": long_q},
        ],
        "_response": [{"role": "assistant", "content": long_a}],
        "_system": "",
        "_tools": "",
    }
    cutoff = 40
    ids, labels = encode(tok, template, ex, cutoff=cutoff)
    p1, r1 = enc(tok, U("hi")), enc(tok, A("yo"))
    p2, r2 = enc(tok, U(long_q)), enc(tok, A(long_a))
    s1, t1 = infer_seqlen(len(p1), len(r1), cutoff)
    s2, t2 = infer_seqlen(len(p2), len(r2), cutoff - s1 - t1)
    assert (s1, t1) == (len(p1), len(r1))  # the short first turn is kept whole
    assert ids == p1 + r1 + p2[:s2] + r2[:t2]
    assert labels == [X] * s1 + r1 + [X] * s2 + r2[:t2]
    assert len(ids) <= cutoff


def test_empty_template_and_chatml(tok):
    ex = {
        "_prompt": [{"role": "user", "content": "q"}],
        "_response": [{"role": "assistant", "content": "r"}],
        "_system": "",
        "_tools": "",
    }
    assert encode(tok, get_template("empty", tok), ex)[0] == enc(tok, "q") + enc(tok, "r")
    ids, _ = encode(tok, get_template("chatml", tok, default_system="sys"), ex)
    assert ids == enc(tok, S("sys"), U("q"), A("r"))


def test_tokenizer_chat_template_matches_its_rendering(tok):
    template = get_template(None, tok)
    ex = {
        "_prompt": [
            {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "r1"},
            {"role": "user", "content": "q2"},
        ],
        "_response": [{"role": "assistant", "content": "r2"}],
        "_system": "sys",
        "_tools": "",
    }
    ids, labels = encode(tok, template, ex)
    # The bundled ChatML chat_template renders "<|im_start|>{role}\n{content}<|im_end|>\n" per message.
    rendered = "<|im_start|>system\nsys<|im_end|>\n" + U("q1") + A("r1") + U("q2") + A("r2")
    assert tok.decode(ids) == rendered
    assert [t for t in labels if t != X] == enc(tok, A("r1")) + enc(tok, A("r2"))


def test_sharegpt_broken_records_have_reasons():
    cols, tags = COLUMN_DEFAULTS, TAG_DEFAULTS
    bad_roles = {"conversations": [{"from": "gpt", "value": "a"}, {"from": "human", "value": "b"}]}
    odd = {"conversations": [{"from": "human", "value": "a"}]}
    empty = {"conversations": [{"from": "human", "value": ""}, {"from": "gpt", "value": "b"}]}
    assert convert_sharegpt(bad_roles, cols, tags)["_error"] == "roles not alternating"
    assert convert_sharegpt(odd, cols, tags)["_error"] == "odd number of messages"
    assert convert_sharegpt(empty, cols, tags)["_error"] == "empty turn"
    assert convert_sharegpt({"other": 1}, cols, tags)["_error"] == "missing messages"
    batch = {"conversations": [bad_roles["conversations"], odd["conversations"]]}
    out = convert_batch(batch, formatting="sharegpt", columns=cols, tags=tags, ranking=False)
    assert out["_error"] == ["roles not alternating", "odd number of messages"] and out["_prompt"] == [[], []]


def test_columns_object_does_not_merge_with_defaults(tmp_path):
    (tmp_path / "d.json").write_text("[]")
    info = {
        "given": {"file_name": "d.json", "columns": {"prompt": "q", "response": "a"}},
        "plain": {"file_name": "d.json", "formatting": "sharegpt", "tags": {"role_tag": "role"}},
    }
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    given, plain = resolve_datasets("given,plain", str(tmp_path))
    assert given.columns["prompt"] == "q" and given.columns["response"] == "a"
    assert given.columns["query"] is None and given.columns["messages"] is None  # not the defaults
    assert plain.columns == COLUMN_DEFAULTS
    assert (
        plain.tags["role_tag"] == "role"
        and plain.tags["content_tag"] is None
        and plain.tags["user_tag"] is None
    )
    with pytest.raises(ValueError, match=r"'missing' is not in .*dataset_info.json"):
        resolve_datasets("missing", str(tmp_path))
    with pytest.raises(ValueError, match="remote datasets"):
        resolve_datasets({"hf_hub_url": "x/y", "file_name": "d.json"}, str(tmp_path))


def test_greedy_knapsack_is_llamafactory_greedy():
    # sorted [1, 2, 3, 5, 8]; bin 1 takes 8 then 2 (cap 10); bin 2 takes 5, 3, 1 (cap 10, 9 used).
    assert greedy_knapsack([5, 1, 8, 3, 2], 10) == [[8, 2], [5, 3, 1]]
    assert greedy_knapsack([4, 4, 4], 9) == [[4, 4], [4]]


def test_pack_examples_rows_and_neat_segments():
    examples = [([1, 2, 3], [X, 2, 3]), ([4, 5], [X, 5]), ([6, 7, 8, 9, 10, 11, 12], [X] * 7)]
    rows = pack_examples(examples, cutoff_len=8, pad_id=0, neat=True)
    # capacity 7: bin 1 = [7] (the 7-token example), bin 2 = 3 then 2 tokens (LIFO per length).
    assert rows["input_ids"] == [[6, 7, 8, 9, 10, 11, 12, 0], [1, 2, 3, 4, 5, 0, 0, 0]]
    assert rows["labels"][1] == [X, 2, 3, X, 5, X, X, X]
    assert rows["position_ids"][1] == [0, 1, 2, 0, 1, 0, 0, 0]
    assert rows["segment_ids"] == [[1, 1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 2, 2, 0, 0, 0]]
    plain = pack_examples(examples + [(list(range(9)), [X] * 9)], cutoff_len=8, pad_id=0, neat=False)
    assert "segment_ids" not in plain and len(plain["input_ids"]) == 2  # the 9-token example is dropped


def test_openai_messages_tool_calls_and_merged_tool_results():
    from meshforge.data.sft.converters import convert_openai
    from meshforge.data.sft.dataset_info import OPENAI_DEFAULTS

    record = {
        "messages": [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}],
            },
            {"role": "tool", "content": "r1"},
            {"role": "tool", "content": "r2"},
            {"role": "assistant", "content": "done"},
        ]
    }
    ex = convert_openai(record, {**COLUMN_DEFAULTS, "messages": "messages"}, OPENAI_DEFAULTS)
    assert ex["_error"] == ""
    assert ex["_prompt"] == [
        {"role": "user", "content": "q"},
        {"role": "function", "content": '[{"name": "f", "arguments": "{}"}]'},
        {"role": "observation", "content": "r1\n</tool_response>\n<tool_response>\nr2"},
    ]
    assert ex["_response"] == [{"role": "assistant", "content": "done"}]


def test_gpt_harmony_efficient_eos_and_mask_history(tok):
    template = get_template("gpt", tok)
    assert template.efficient_eos
    ex = {
        "_prompt": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
        ],
        "_response": [{"role": "assistant", "content": "d"}],
        "_system": "",
        "_tools": "",
    }
    eos = tok.eos_token_id
    empty = enc(tok, "<|channel|>analysis<|message|><|end|><|start|>assistant<|channel|>final<|message|>")
    sys_ids = enc(
        tok, "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.<|end|>"
    )
    p1 = sys_ids + enc(tok, "<|start|>user<|message|>a<|end|><|start|>assistant")
    p2 = enc(tok, "<|start|>user<|message|>c<|end|><|start|>assistant")
    r1, r2 = empty + enc(tok, "b"), empty + enc(tok, "d")
    ids, labels = encode(tok, template, ex)
    # No eos after each answer: the second prompt's first label is eos (answer 1 ends there), and
    # one eos closes the example.
    assert ids == p1 + r1 + p2 + r2 + [eos]
    assert labels == [X] * len(p1) + r1 + [eos] + [X] * (len(p2) - 1) + r2 + [eos]
    # mask_history: only the last answer (and the final eos) is trained, not answer 1's eos either.
    template = get_template("gpt", tok, mask_history=True)
    ids, labels = encode(tok, template, ex, mask_history=True)
    assert ids == p1 + enc(tok, "b") + p2 + r2 + [eos]
    assert labels == [X] * (len(p1) + 1 + len(p2)) + r2 + [eos]
    with pytest.raises(ValueError, match="train_on_prompt"):
        from meshforge.config import config_from_dict
        from meshforge.data.sft.loader import build_sft_columns

        cfg = config_from_dict(
            {
                "train_dataset": {
                    "dataloader": {"type": "SFTDataLoader"},
                    "template": "gpt",
                    "dataset": {"file_name": "x.json"},
                    "train_on_prompt": True,
                }
            }
        ).train_dataset
        build_sft_columns(cfg, tok, seed=0)


def test_config_template_names_match_the_built_templates():
    from meshforge.config import ConfigError, config_from_dict
    from meshforge.data.sft.specs import TEMPLATE_NAMES
    from meshforge.data.sft.templates import TEMPLATES

    assert sorted(TEMPLATE_NAMES) == sorted(TEMPLATES)
    with pytest.raises(ConfigError, match=r"train_dataset.template: unknown template 'qwen9'"):
        config_from_dict({"train_dataset": {"template": "qwen9"}})
