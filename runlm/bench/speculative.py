"""`runlm bench --drafts`: speculative decoding off and on, in alternating rounds on one loaded model.

Two requests: a copy-heavy one (rewrite a block of runlm's own source with one name changed, greedy), where
prompt lookup should pay, and free text (a story, sampled with a seed per round), where drafts rarely hold and
their cost shows. Each round runs both modes on the same request; a ratio is on-over-off decode tok/s of one
round, and the table gives their median and range, the drafted tokens the model kept, and whether the replies
were the same token for token (they must be).
"""

from __future__ import annotations

import json
import os
import statistics
from importlib import resources

from runlm.bench.common import machine
from runlm.engine import Engine, GenerationRequest
from runlm.engine.speculative import Speculation
from runlm.runtime import load
from runlm.sampling import SamplingParams

CODE_TOKENS = 400  # the code block's length, about


def code_block(tokenizer) -> str:
    """About CODE_TOKENS tokens of a module of runlm's own (whole lines), shipped with the package."""
    lines, text = resources.files("runlm").joinpath("engine/prompt_cache.py").read_text().splitlines(), ""
    for line in lines:
        if len(tokenizer.encode(text + line + "\n")) > CODE_TOKENS:
            break
        text += line + "\n"
    return text


def requests(loaded) -> dict[str, tuple[list[int], int, float]]:
    """name -> (prompt ids, max tokens, temperature)."""
    def prompt(content: str) -> list[int]:
        messages = [{"role": "user", "content": content}]
        if loaded.chat_template is None:
            return loaded.tokenizer.encode(content)
        return loaded.tokenizer.encode_prompt(loaded.chat_template.render(messages, add_generation_prompt=True))

    code = code_block(loaded.tokenizer)
    return {
        "copy-heavy (rewrite code, greedy)": (prompt(
            "Rewrite this Python code exactly, with one change: rename the class PromptCache to PrefixCache. "
            "Output only the code.\n\n" + code), CODE_TOKENS + 64, 0.0),
        "free text (a story, sampled)": (prompt(
            "Write a short story about a lighthouse keeper who finds a map, with vivid details."), 256, 0.8),
    }


def run_speculative_bench(args) -> int:
    threads = args.threads or os.cpu_count() or 1
    loaded = load(args.model, dtype=args.dtype, kv_type=args.kv_type, threads=threads)
    draft_max = args.draft_max
    print(f"model: {loaded.path.name} ({loaded.runtime} runtime)   threads: {threads}   machine: {machine()}")
    print(f"speculative decoding: prompt lookup, drafts of up to {draft_max} tokens; {args.repeat} alternating rounds")
    print("| request | decode tok/s off | decode tok/s ngram | ngram / off, rounds | drafts kept | same reply |")
    print("|---|---|---|---|---|---|")
    results = {}
    for name, (ids, max_tokens, temperature) in requests(loaded).items():
        rates: dict[str, list[float]] = {"off": [], "ngram": []}
        drafted = accepted = 0
        same = True
        for round_ in range(max(1, args.repeat)):
            replies = {}
            for mode in ("off", "ngram"):
                engine = Engine(loaded.runner, loaded.tokenizer, context_length=loaded.context_length,
                                prompt_cache_mb=0, speculation=Speculation(mode, draft_max))
                sampling = SamplingParams(temperature=temperature, seed=round_)
                done = engine.complete(GenerationRequest(list(ids), max_tokens=max_tokens, sampling=sampling))
                rates[mode].append(done.usage.decode_tokens_per_s)
                replies[mode] = done.token_ids
                if mode == "ngram":
                    drafted += done.usage.draft_tokens
                    accepted += done.usage.accepted_tokens
            same = same and replies["off"] == replies["ngram"]
        ratios = [on / off for on, off in zip(rates["ngram"], rates["off"]) if off > 0]
        kept = f"{accepted}/{drafted} ({accepted / drafted:.0%})" if drafted else "0/0"
        print(f"| {name} | {statistics.median(rates['off']):.1f} | {statistics.median(rates['ngram']):.1f} | "
              f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) | {kept} | "
              f"{'yes' if same else 'NO'} |")
        results[name] = {"off": rates["off"], "ngram": rates["ngram"], "ratios": ratios, "drafted": drafted,
                         "accepted": accepted, "same_reply": same}
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(results, out, indent=1)
    return 0 if all(r["same_reply"] for r in results.values()) else 1


__all__ = ["run_speculative_bench"]
