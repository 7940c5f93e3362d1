"""``traffic generate``: run the target on a prompt set and record its own completions (batched, left-padded).

Records name the model (``meta.model``) and the generation length (``meta.max_new_tokens``); ``skip`` leaves out the
record ids an interrupted run already finished, so a rerun resumes where it stopped."""

from __future__ import annotations

from typing import Collection, Iterator, Sequence

import torch
from tqdm import tqdm

from sglang_spec.models.loading import LoadedModel
from sglang_spec.train.prompts import PromptSpec
from sglang_spec.train.traffic import TrafficRecord


def prompt_tokens(loaded: LoadedModel, spec: PromptSpec) -> list[int]:
    if spec.messages is not None and loaded.chat:
        return list(loaded.tokenizer.apply_chat_template(list(spec.messages), add_generation_prompt=True,
                                                         tokenize=True, return_dict=False))
    text = spec.prompt if spec.prompt is not None else "\n".join(m["content"] for m in spec.messages or ())
    return list(loaded.tokenizer.encode(text))


def generate_traffic(
    loaded: LoadedModel,
    prompts: Sequence[PromptSpec],
    greedy: bool,
    samples: int,
    temperature: float,
    max_new_tokens: int,
    batch_size: int,
    seed: int,
    reference: bool,
    progress: bool = True,
    skip: Collection[str] = (),
) -> Iterator[TrafficRecord]:
    """Yields one record per (prompt, completion): the greedy one if asked, then ``samples`` sampled ones, then
    the prompt's reference answer when ``reference`` (marked source="reference"). Record ids in ``skip`` are not
    generated again."""
    runs = ([("greedy", 0.0)] if greedy else []) + [(f"sample{i}", temperature) for i in range(samples)]
    encoded = [(spec, prompt_tokens(loaded, spec)) for spec in prompts]
    by_length = sorted(range(len(encoded)), key=lambda i: len(encoded[i][1]))  # similar lengths batch together
    torch.manual_seed(seed)
    pad = loaded.tokenizer.pad_token_id if getattr(loaded.tokenizer, "pad_token_id", None) is not None else 0
    todo = {tag: [i for i in by_length if f"{encoded[i][0].id}/{tag}" not in skip] for tag, _ in runs}
    bar = tqdm(total=sum(map(len, todo.values())), desc="generating traffic", unit="completion",
               disable=not progress)
    for tag, run_temperature in runs:
        order = todo[tag]
        for start in range(0, len(order), batch_size):
            chunk = [encoded[i] for i in order[start : start + batch_size]]
            width = max(len(tokens) for _, tokens in chunk)
            input_ids = torch.full((len(chunk), width), pad, dtype=torch.int64)
            attention = torch.zeros((len(chunk), width), dtype=torch.int64)
            for row, (_, tokens) in enumerate(chunk):
                input_ids[row, width - len(tokens) :] = torch.tensor(tokens)
                attention[row, width - len(tokens) :] = 1
            with torch.no_grad():
                output = loaded.model.generate(
                    input_ids=input_ids,
                    attention_mask=attention,
                    max_new_tokens=max_new_tokens,
                    do_sample=run_temperature > 0,
                    temperature=run_temperature if run_temperature > 0 else None,
                    top_k=0 if run_temperature > 0 else None,
                    top_p=1.0 if run_temperature > 0 else None,
                    pad_token_id=pad,
                    eos_token_id=list(loaded.eos_token_ids) or None,
                )
            for row, (spec, _) in enumerate(chunk):
                generated = output[row, width:].tolist()
                for end, token in enumerate(generated):
                    if token in loaded.eos_token_ids:
                        generated = generated[:end]
                        break
                yield TrafficRecord(
                    id=f"{spec.id}/{tag}",
                    domain=spec.domain,
                    completion=loaded.decode(generated),
                    prompt=spec.prompt,
                    messages=spec.messages if spec.prompt is None else None,
                    source=f"generate {loaded.name} temperature={run_temperature}",
                    meta={"completion_tokens": len(generated), "model": loaded.name,
                          "max_new_tokens": max_new_tokens},
                )
            bar.update(len(chunk))
    bar.close()
    if reference:
        for spec in prompts:
            if spec.reference and f"{spec.id}/reference" not in skip:
                yield TrafficRecord(
                    id=f"{spec.id}/reference", domain=spec.domain, completion=spec.reference, prompt=spec.prompt,
                    messages=spec.messages if spec.prompt is None else None, source="reference",
                )
