"""A small SGLang-compatible HTTP endpoint on a CPU, backed by sglang_spec's reference tree-speculative decoder.

It speaks the subset of SGLang's native API that ``sglang.lang``'s RuntimeEndpoint uses (``GET /get_model_info``,
``POST /generate``, plus ``/health`` and ``/get_server_info`` with the mean accept length), so frontend programs
can be tried without a GPU. It is a reference, not a server: one request at a time.

    python examples/cpu_reference_server.py --model smollm2 --policy sequoia --budget 8 --depth 4 --port 30000
"""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from sglang_spec.catalog import load_model
from sglang_spec.decode.decoder import GenerationConfig, SpeculativeDecoder
from sglang_spec.models.registry import load_head_for, shipped_profile_path
from sglang_spec.sampling import SamplingParams
from sglang_spec.tree.policies import TreePolicy
from sglang_spec.tree.profile import AcceptanceProfile


class ReferenceBackend:
    def __init__(self, model: str, policy: str, budget: int, depth: int, mtp: str | None = None) -> None:
        self.loaded = load_model(model, progress=False)
        head = load_head_for(self.loaded, mtp)
        profile = AcceptanceProfile.load(shipped_profile_path(model))
        self.decoder = SpeculativeDecoder(self.loaded.model, head, TreePolicy(policy, budget, depth, profile=profile))
        self.lock = threading.Lock()
        self.accept_lengths: list[int] = []

    def generate(self, text: str, sampling: dict) -> dict:
        tokens = self.loaded.tokenizer.encode(text)
        max_new_tokens = int(sampling.get("max_new_tokens", 128) or 0)
        if max_new_tokens == 0 or not tokens:
            return {"text": "", "meta_info": {"prompt_tokens": len(tokens), "completion_tokens": 0}}
        params = SamplingParams(temperature=float(sampling.get("temperature", 0.0) or 0.0),
                                top_k=max(int(sampling.get("top_k", 0) or 0), 0),
                                top_p=float(sampling.get("top_p", 1.0) or 1.0))
        config = GenerationConfig(max_new_tokens=max_new_tokens, sampling=params,
                                  eos_token_ids=self.loaded.eos_token_ids)
        with self.lock:
            output = self.decoder.generate([tokens], config)
        request = output.requests[0]
        self.accept_lengths += request.accept_lengths
        completion = self.loaded.decode(request.tokens)
        for marker in [*(sampling.get("stop") or []), "<|im_end|>"]:
            if marker and marker in completion:
                completion = completion[: completion.index(marker)]
        return {"text": completion, "meta_info": {
            "prompt_tokens": len(tokens), "completion_tokens": len(request.tokens),
            "finish_reason": {"type": request.finish_reason},
            "spec_accept_length": output.accept_length_mean,
        }}

    def server_info(self) -> dict:
        lengths = self.accept_lengths
        return {"avg_spec_accept_length": sum(lengths) / len(lengths) if lengths else None,
                "speculative_algorithm": "NEXTN (sglang_spec reference decoder)",
                "speculative_tree_policy": self.decoder.policy.name}


def make_handler(backend: ReferenceBackend, model_name: str):
    class Handler(BaseHTTPRequestHandler):
        def _send(self, status: int, payload: dict) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/get_model_info":
                self._send(200, {"model_path": model_name, "is_generation": True})
            elif self.path == "/health":
                self._send(200, {})
            elif self.path == "/get_server_info":
                self._send(200, backend.server_info())
            else:
                self._send(404, {"error": f"unknown path {self.path}"})

        def do_POST(self) -> None:  # noqa: N802
            if self.path != "/generate":
                self._send(404, {"error": f"unknown path {self.path}"})
                return
            length = int(self.headers.get("Content-Length", 0))
            try:
                request = json.loads(self.rfile.read(length) or b"{}")
                text = request["text"]
            except (json.JSONDecodeError, KeyError):
                self._send(400, {"error": "POST /generate needs a JSON body with 'text'"})
                return
            if isinstance(text, list):
                self._send(200, [backend.generate(item, request.get("sampling_params") or {}) for item in text])
            else:
                self._send(200, backend.generate(text, request.get("sampling_params") or {}))

        def log_message(self, format: str, *args) -> None:  # quiet
            pass

    return Handler


def serve(backend: ReferenceBackend, model_name: str, host: str, port: int) -> ThreadingHTTPServer:
    return ThreadingHTTPServer((host, port), make_handler(backend, model_name))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--mtp", default=None)
    parser.add_argument("--policy", default="sequoia")
    parser.add_argument("--budget", type=int, default=8)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    args = parser.parse_args(argv)
    backend = ReferenceBackend(args.model, args.policy, args.budget, args.depth, args.mtp)
    server = serve(backend, args.model, args.host, args.port)
    print(f"serving {args.model} ({args.policy} budget {args.budget}) on http://{args.host}:{args.port}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
