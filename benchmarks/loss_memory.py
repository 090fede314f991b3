"""Peak memory of the LM loss: full-vocabulary logits vs the chunked cross-entropy, on CPU.

Two measurements, each configuration in its own child process (a fresh address space, so
Linux's ``VmHWM`` is that configuration's peak resident set alone, as in
``benchmarks/step_throughput.py``):

* ``loss``: the loss alone at vocab 151,936: hidden states ``[tokens, hidden]`` and an LM-head
  weight ``[vocab, hidden]`` (both requiring grad), forward and backward of the summed
  cross-entropy, plain (``logits = h @ W.T``, ``cross_entropy_sum``) vs
  ``chunked_cross_entropy_sum`` (``kernels.chunk_loss_size``).
* ``step``: a whole training step (forward, loss / tokens, backward, fused AdamW step) of a
  Qwen3 model with hidden 512, 8 layers, seq 512, batch 4, vocab 151,936: transformers'
  ``Qwen3ForCausalLM`` (the reference peak), meshforge's Qwen3 with the plain loss, and
  meshforge's Qwen3 with the chunked loss. All three start from the same weights (the
  reference's initialisation, saved once by the parent; meshforge's children build on the meta
  device and assign them, so no child ever holds two copies) and the same batch, so their
  losses must agree. The loss of the transformers step is ``cross_entropy_sum`` on its logits,
  the same arithmetic as its own ``ForCausalLMLoss`` (float32 logits, no extra copy). Two steps
  are run (the second with the AdamW state allocated). The model is tied like the small Qwen3
  checkpoints (0.6B, 1.7B); ``--untied`` gives the head its own weight.

Reported per child: peak RSS (MB), the peak minus the RSS just before the measured part
(torch and transformers imported, inputs built), seconds, and the loss. The ratios divide
meshforge's peaks by the plain/transformers ones.

Run: ``python benchmarks/loss_memory.py [--part loss|step|all] [--chunk 128] [--threads 2] [--untied]``.
Prints one JSON line per part.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _harness import emit, rss_mb  # noqa: E402

VOCAB = 151_936
STEP_SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    tie_word_embeddings=True,  # as the small Qwen3 models (0.6B, 1.7B); --untied for a separate head
)
SEQ, BATCH = 512, 4


def _loss_child(mode: str, chunk: int, tokens: int, hidden: int) -> dict:
    import torch

    from meshforge.loss.cross_entropy import chunked_cross_entropy_sum, cross_entropy_sum

    gen = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=gen).mul_(0.5).requires_grad_()
    w = (
        torch.randn(VOCAB, hidden, generator=gen).mul_(0.02).requires_grad_()
    )  # in place: no transient copy in the baseline
    labels = torch.randint(0, VOCAB, (tokens,), generator=gen)
    if mode == "fused" or mode.endswith("_compiled"):
        return _lm_loss_child(mode, chunk, h, w, labels, tokens)
    before = rss_mb()
    start = time.perf_counter()
    if mode == "plain":
        loss = cross_entropy_sum(h @ w.t(), labels)
    else:
        loss = chunked_cross_entropy_sum(h, w, labels, chunk_size=chunk)
    (loss / tokens).backward()
    return {"loss": loss.item() / tokens, "seconds": time.perf_counter() - start, "before_mb": before}


def _lm_loss_child(mode: str, chunk: int, h, w, labels, tokens: int) -> dict:
    """The fused loss and the compiled losses through ``meshforge.loss.lm.LMLoss``.

    The fused loss uses its default chunk at this vocabulary (512 tokens). Compiled modes run once first (the compile, outside the measured peak and time) and are
    then timed as the median of three calls; their peak RSS includes the compiler's own memory.
    """
    import statistics

    from meshforge.loss.lm import LMLoss, fused_chunk_size

    name = mode.removesuffix("_compiled")
    if name == "fused":
        chunk = fused_chunk_size(VOCAB)  # the default chunk of fused_linear_cross_entropy: auto
    backend = "inductor" if mode.endswith("_compiled") else None
    fn = LMLoss("logits", None, backend) if name == "plain" else LMLoss(name, chunk, backend)  # type: ignore[arg-type]

    def once() -> float:
        loss = fn(h @ w.t(), labels) if name == "plain" else fn(h, labels, w)
        (loss / tokens).backward()
        h.grad = w.grad = None
        return float(loss.item()) / tokens

    before = rss_mb()
    if backend is None:
        start = time.perf_counter()
        value = once()
        return {"loss": value, "seconds": time.perf_counter() - start, "before_mb": before}
    value = once()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    return {"loss": value, "seconds": statistics.median(times), "before_mb": before}


def _build_hf(args):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(**{**args.to_hf_dict(), "use_cache": False})
    config._attn_implementation = "sdpa"
    return transformers.Qwen3ForCausalLM(config).float().train()


def _step_args(tied: bool):
    from meshforge.models.qwen3.args import Qwen3Args

    return Qwen3Args(
        **{**STEP_SHAPE, "tie_word_embeddings": tied}, max_position_embeddings=2048, rope_theta=1e6
    )


def _save_reference_weights(path: str, tied: bool) -> None:
    import torch

    torch.save(_build_hf(_step_args(tied)).state_dict(), path)


def _step_child(mode: str, chunk: int, tied: bool, weights: str) -> dict:
    import torch
    import transformers  # noqa: F401  (every child pays the same import, so baselines match)

    from meshforge.loss.cross_entropy import chunked_cross_entropy_sum, cross_entropy_sum
    from meshforge.models.qwen3.model import Qwen3ForCausalLM

    args = _step_args(tied)
    if mode == "transformers":
        model = _build_hf(args)
    else:
        # The reference's initial weights, saved by the parent: built on the meta device and
        # assigned, so this process never holds two copies (its baseline matches the reference's).
        with torch.device("meta"):
            model = Qwen3ForCausalLM(args)
        state = torch.load(weights, weights_only=True)
        model.load_state_dict(state, strict=True, assign=True)
        model.tie_weights()
        model.train()
        del state
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    inputs, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    before = rss_mb()
    losses, start = [], time.perf_counter()
    for _ in range(2):
        if mode == "transformers":
            logits = model(input_ids=inputs).logits
            loss_sum = cross_entropy_sum(logits, labels)
            del logits
        elif mode == "plain":
            loss_sum = cross_entropy_sum(model(inputs), labels)
        else:
            hidden = model(inputs, return_hidden=True)
            loss_sum = chunked_cross_entropy_sum(hidden, model.lm_head.weight, labels, chunk_size=chunk)
            del hidden
        loss = loss_sum / labels.numel()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "seconds": time.perf_counter() - start, "before_mb": before}


def _run_child(argv: list[str], threads: int) -> dict:
    cmd = [sys.executable, __file__, "--child", *argv, "--threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _summary(child: dict) -> dict:
    return {
        "peak_rss_mb": round(child["peak_mb"], 1),
        "over_baseline_mb": round(child["peak_mb"] - child["before_mb"], 1),
        "seconds": round(child["seconds"], 2),
        **{k: child[k] for k in ("loss", "losses") if k in child},
    }


def bench_loss(chunk: int, threads: int, tokens: int = 2048, hidden: int = 512) -> dict:
    out = {
        mode: _summary(_run_child(["loss", mode, str(chunk), str(tokens), str(hidden)], threads))
        for mode in ("plain", "chunked", "fused", "plain_compiled", "fused_compiled")
    }
    plain, chunked = out["plain"], out["chunked"]
    return {
        "part": "loss",
        "vocab": VOCAB,
        "tokens": tokens,
        "hidden": hidden,
        "chunk_loss_size": chunk,
        **out,
        "peak_ratio": round(chunked["peak_rss_mb"] / plain["peak_rss_mb"], 3),
        "over_baseline_ratio": round(chunked["over_baseline_mb"] / plain["over_baseline_mb"], 3),
        "loss_abs_diff": abs(plain["loss"] - chunked["loss"]),
        "fused_peak_ratio": round(out["fused"]["peak_rss_mb"] / plain["peak_rss_mb"], 3),
        "fused_loss_abs_diff": abs(plain["loss"] - out["fused"]["loss"]),
        "fused_compiled_over_plain_compiled_time": round(
            out["fused_compiled"]["seconds"] / out["plain_compiled"]["seconds"], 3
        ),
    }


def bench_step(chunk: int, threads: int, tied: bool = True) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        weights = os.path.join(tmp, "reference.pt")
        _run_child(["save", weights, str(int(tied))], threads)
        out = {
            mode: _summary(_run_child(["step", mode, str(chunk), str(int(tied)), weights], threads))
            for mode in ("transformers", "plain", "chunked")
        }
    ref = out["transformers"]
    return {
        "part": "step",
        "shape": {**STEP_SHAPE, "tie_word_embeddings": tied, "seq": SEQ, "batch": BATCH},
        "chunk_loss_size": chunk,
        "transformers": ref,
        "meshforge_plain": out["plain"],
        "meshforge_chunked": out["chunked"],
        "chunked_peak_over_transformers": round(out["chunked"]["peak_rss_mb"] / ref["peak_rss_mb"], 3),
        "plain_peak_over_transformers": round(out["plain"]["peak_rss_mb"] / ref["peak_rss_mb"], 3),
        "max_loss_rel_diff": max(
            abs(a - b) / abs(b) for a, b in zip(out["chunked"]["losses"], ref["losses"], strict=True)
        ),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("loss", "step", "all"), default="all")
    parser.add_argument("--chunk", type=int, default=128, help="kernels.chunk_loss_size (tokens)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--untied", action="store_true", help="separate LM head (more parameter memory)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.child:
        import torch

        torch.set_num_threads(ns.threads)
        kind, mode, *rest = ns.child
        if kind == "save":
            _save_reference_weights(mode, bool(int(rest[0])))
            result = {"seconds": 0.0, "before_mb": 0.0}
        elif kind == "loss":
            result = _loss_child(mode, int(rest[0]), int(rest[1]), int(rest[2]))
        else:
            result = _step_child(mode, int(rest[0]), bool(int(rest[1])), rest[2])
        emit({**result, "peak_mb": rss_mb()})
        return
    if ns.part in ("loss", "all"):
        emit(bench_loss(ns.chunk, ns.threads))
    if ns.part in ("step", "all"):
        emit(bench_step(ns.chunk, ns.threads, tied=not ns.untied))


if __name__ == "__main__":
    main()
