"""SGLang's real server on this CPU (``python -m sglang.launch_server`` with our plugin and the CPU harness).

Every server a test starts runs in its own process group with a hard start-up timeout and is stopped (group
signalled, then killed) when its fixture ends; its log is checked for tracebacks, since a normal launch must
log none. Servers are module- or parameter-scoped so pytest starts each configuration once.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cpu_server_helpers import (REPEAT_CONTEXT_PROMPTS, REPEAT_NEW_TOKENS, SMOLLM2_NEW_TOKENS,
                               TINY_NEW_TOKENS, running_server)
from optional_packages import require_sglang
from sglang_spec.models.cache_dir import build_lock
from sglang_spec.files import write_json_atomic
from sglang_spec_testbed.parity import PARITY_SERVER_ARGS, plain_oracle
from sglang_spec_testbed.server import CpuModel, prepare_model


def once_per_run(tmp_path_factory, logs: Path, name: str, compute: Callable[[Path], Any]) -> Any:
    """``compute(folder)`` (JSON-valued: a plain server's answers, its server log written into ``folder`` as
    ``<name>.log``) once per test run: under parallel workers (pytest-xdist) the first to ask computes it into the
    run's shared temporary folder and the others wait for it and read it, so a plain oracle server starts once,
    not once per worker. Either way the value comes back through JSON (lists, never tuples) and the log is in
    ``logs``."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return json.loads(json.dumps(compute(logs)))
    shared = tmp_path_factory.getbasetemp().parent / "once-per-run"
    shared.mkdir(exist_ok=True)
    path = shared / f"{name}.json"
    with build_lock(path):
        if not path.exists():
            write_json_atomic(path, compute(shared))
    shutil.copyfile(shared / f"{name}.log", logs / f"{name}.log")
    return json.loads(path.read_text())


@pytest.fixture(scope="session")
def smollm2_cpu() -> CpuModel:
    require_sglang()
    return prepare_model("smollm2", progress=False)


@pytest.fixture(scope="session")
def smollm2_split_cpu(smollm2_cpu) -> CpuModel:
    """SmolLM2 with zero attention heads appended (12 query / 4 KV heads): its outputs, on two ranks."""
    return prepare_model("smollm2-split", progress=False)


@pytest.fixture(scope="session")
def tiny_cpu() -> CpuModel:
    require_sglang()
    return prepare_model("tiny-deepseek", progress=False)


@pytest.fixture(scope="session")
def server_logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sglang-server-logs")


@pytest.fixture(scope="session")
def smollm2_prompts(smollm2_cpu) -> list[list[int]]:
    """Held-out HumanEval tasks 130-133 (never in the shipped head's training traffic), as chat requests."""
    from transformers import AutoTokenizer

    from sglang_spec.train.prompts import humaneval_prompts

    tokenizer = AutoTokenizer.from_pretrained(smollm2_cpu.target_dir)
    return [list(tokenizer.apply_chat_template(list(spec.messages), add_generation_prompt=True, tokenize=True,
                                               return_dict=False))
            for spec in humaneval_prompts(130, 133)]


@pytest.fixture(scope="session")
def smollm2_plain_runs(tmp_path_factory, smollm2_cpu, server_logs, smollm2_prompts) -> dict:
    """What one SGLang server without speculation answers, greedy: ``heldout`` (the held-out prompts' output ids),
    ``repeat_context`` (REPEAT_CONTEXT_PROMPTS') and ``parity`` (test_parity_under_load.py's request set, its oracle:
    the server runs at that test's context length, which leaves the other answers as they are)."""
    def compute(logs: Path) -> dict:
        from transformers import AutoTokenizer

        with running_server(smollm2_cpu, logs, "smollm2-plain", PARITY_SERVER_ARGS,
                            speculative=False) as server:
            heldout = server.generate(smollm2_prompts, {"temperature": 0, "max_new_tokens": SMOLLM2_NEW_TOKENS})
            repeat = server.generate(list(REPEAT_CONTEXT_PROMPTS),
                                     {"temperature": 0, "max_new_tokens": REPEAT_NEW_TOKENS})
            parity = plain_oracle(server.port, AutoTokenizer.from_pretrained(smollm2_cpu.target_dir),
                                  smollm2_prompts)
        return {"heldout": [answer["output_ids"] for answer in heldout],
                "repeat_context": [answer["output_ids"] for answer in repeat], "parity": parity}

    return once_per_run(tmp_path_factory, server_logs, "smollm2-plain", compute)


@pytest.fixture(scope="session")
def smollm2_plain(smollm2_plain_runs) -> list[list[int]]:
    """Greedy output of SGLang's server without speculation on the held-out prompts."""
    return smollm2_plain_runs["heldout"]


@pytest.fixture(scope="session")
def tiny_prompts() -> list[list[int]]:
    """Toy-language prompts from the tiny model's own language, with branching successors: drafts miss often
    enough that acceptance is a measurement, not a constant."""
    from sglang_spec.models.tiny_deepseek import TINY_DEEPSEEK_CONFIG
    from sglang_spec.models.toy_language import ToyLanguage

    return ToyLanguage(TINY_DEEPSEEK_CONFIG["vocab_size"], seed=999).sample(4, 10).tolist()


@pytest.fixture(scope="session")
def tiny_copy_prompts() -> list[list[int]]:
    """The tiny model's likeliest text: from a start token, each token's most likely successor in the language it
    was trained on, 24 tokens that go round a cycle of the chain twice or more (from the first two start tokens
    whose walk comes round within 12). The model's greedy continuation goes round again, so a lookup tree finds it
    in the context and is accepted (``tiny_prompts`` rarely give lookup a match)."""
    from sglang_spec.models.tiny_deepseek import TINY_DEEPSEEK_CONFIG
    from sglang_spec.models.toy_language import ToyLanguage
    from sglang_spec.train.build_tiny_deepseek import LANGUAGE_SEED

    likeliest = ToyLanguage(TINY_DEEPSEEK_CONFIG["vocab_size"], seed=LANGUAGE_SEED).successors[:, 0].tolist()

    def walk(start: int, length: int) -> list[int]:
        tokens = [start]
        while len(tokens) < length:
            tokens.append(likeliest[tokens[-1]])
        return tokens

    starts = [start for start in range(2, len(likeliest)) if len(set(walk(start, 12))) < 12][:2]
    return [walk(start, 24) for start in starts]


@pytest.fixture(scope="session")
def tiny_plain_runs(tmp_path_factory, tiny_cpu, server_logs, tiny_prompts, tiny_copy_prompts) -> dict:
    """Greedy output (TINY_NEW_TOKENS) of one tensor-parallel rank without speculation: ``toy`` on
    ``tiny_prompts``, ``copy`` on ``tiny_copy_prompts`` (one server answers both)."""
    def compute(logs: Path) -> dict:
        with running_server(tiny_cpu, logs, "tiny-plain", speculative=False) as server:
            toy, copy = (server.generate(prompts, {"temperature": 0, "max_new_tokens": TINY_NEW_TOKENS})
                         for prompts in (tiny_prompts, tiny_copy_prompts))
        return {"toy": [answer["output_ids"] for answer in toy], "copy": [answer["output_ids"] for answer in copy]}

    return once_per_run(tmp_path_factory, server_logs, "tiny-plain", compute)


@pytest.fixture(scope="session")
def tiny_plain(tiny_plain_runs) -> list[list[int]]:
    """Greedy output (TINY_NEW_TOKENS) of one tensor-parallel rank without speculation on ``tiny_prompts``."""
    return tiny_plain_runs["toy"]
