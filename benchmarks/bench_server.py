"""Load test of `gali serve`: concurrent clients against one server; throughput, latency percentiles, nothing lost.

    python benchmarks/bench_server.py                        # starts `gali serve -m demo` on a free local port
    python benchmarks/bench_server.py --clients 8 --requests 4 --document-tokens 2048
    python benchmarks/bench_server.py --url http://127.0.0.1:8000 --model demo   # a server already running

Each client is a thread with the official openai client, sending its requests one after another as streamed chat
completions: even requests ask a question about one of two held-out documents (--document-tokens long, 16x the demo
model's window by default; clients share them, so most find the document's prefilled state in memory or in the
document cache), odd ones a short prompt. A 429 (queue full) is retried after its Retry-After and counted. Every
request must end with a finish_reason and the usage the server reports: one that does not is lost, and the run
fails. Bounded: clients x requests requests, --timeout seconds in all, local addresses only.
"""

import argparse
import ipaddress
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import sysconfig
import threading
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from urllib.parse import urlsplit

import openai


@dataclass
class Outcome:
    """One request as its client saw it."""

    kind: str  # "document, read", "document, reused" (its prefilled state found) or "short"
    first_token: float  # seconds from the first attempt to the first piece of text (the end, for an empty answer)
    total: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    retries: int


def local_only(url: str) -> str:
    """`url` if its host is this machine (a load test never leaves it); else exit."""
    host = urlsplit(url).hostname or ""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror:
        addresses = set()
    if not addresses or not all(ipaddress.ip_address(address.split("%")[0]).is_loopback for address in addresses):
        sys.exit(f"--url {url}: the load test only runs against this machine (127.0.0.1, ::1, localhost)")
    return url.rstrip("/")


def start_server(model: str, queue_size: int, extra: list[str]) -> tuple[subprocess.Popen, str]:
    """`gali serve` on a free port of 127.0.0.1, with its stderr passed on; returns it and its URL."""
    command = [sys.executable, "-m", "gali_cli", "serve", "-m", model, "--port", "0", "--queue-size", str(queue_size),
               *extra]
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    for line in server.stderr:
        sys.stderr.write(line)
        if found := re.search(r"http://127\.0\.0\.1:\d+", line):
            threading.Thread(target=lambda: [sys.stderr.write(rest) for rest in server.stderr], daemon=True).start()
            return server, found.group()
    sys.exit(f"gali serve did not start (exit {server.wait()})")


def documents(tokens: int) -> list[str]:
    """Two stdlib files the demo model never saw, cut to about `tokens` tokens (4 characters a token is close for
    Python source with its tokenizer; the server reports the exact count)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [(stdlib / name).read_text()[: 4 * tokens] for name in ("difflib.py", "textwrap.py")]


def one_request(client: openai.OpenAI, model: str, content: str, kind: str, max_tokens: int) -> Outcome:
    retries, started = 0, time.perf_counter()  # latencies count the waits after a 429 too
    while True:
        first = None
        try:
            stream = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": content}], max_tokens=max_tokens, stream=True,
                stream_options={"include_usage": True})
            finish, usage = None, None
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content and first is None:
                    first = time.perf_counter() - started
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                usage = chunk.usage or usage
        except openai.RateLimitError as error:
            retries += 1
            time.sleep(float(error.response.headers.get("retry-after", "1")))
            continue
        total = time.perf_counter() - started
        if finish is None or usage is None:
            raise RuntimeError(f"a {kind} request ended without finish_reason or usage")
        cached = usage.prompt_tokens_details.cached_tokens
        if kind == "document":
            kind = "document, reused" if cached else "document, read"
        return Outcome(kind, first if first is not None else total, total, usage.prompt_tokens, cached,
                       usage.completion_tokens, retries)


def percentiles(values: list[float]) -> str:
    cuts = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return f"{statistics.median(values):.2f} / {cuts[89]:.2f} / {cuts[98]:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a gali server already running on this machine (default: start one)")
    parser.add_argument("--model", default="demo")
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--requests", type=int, default=4, help="per client")
    parser.add_argument("--document-tokens", type=int, default=4096)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--queue-size", type=int, default=4, help="of the server started here (below --clients: "
                                                                  "some requests meet a full queue)")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("serve_options", nargs="*", help="more `gali serve` options, after --")
    args = parser.parse_args()
    if args.clients < 1 or args.requests < 1 or args.clients * args.requests > 1000:
        sys.exit("--clients and --requests: at least 1 each, at most 1000 requests in all")
    server, url = (None, local_only(args.url)) if args.url else start_server(args.model, args.queue_size,
                                                                              args.serve_options)
    texts = documents(args.document_tokens)
    outcomes: list[Outcome] = []
    failures: list[str] = []

    def client_loop(index: int) -> None:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="load-test", max_retries=0, timeout=args.timeout)
        for number in range(args.requests):
            if (index + number) % 2 == 0:
                question = f"Client {index}, question {number}: what does this do?"
                content, kind = f"{texts[index % 2]}\n\n{question}", "document"
            else:
                content, kind = f"def client_{index}_request_{number}(", "short"
            try:
                outcomes.append(one_request(client, args.model, content, kind, args.max_tokens))
            except Exception as error:  # counted as lost, and reported
                failures.append(f"client {index} request {number}: {type(error).__name__}: {error}")

    started = time.perf_counter()
    threads = [threading.Thread(target=client_loop, args=(index,), daemon=True) for index in range(args.clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, args.timeout - (time.perf_counter() - started)))
    wall = time.perf_counter() - started
    timed_out = any(thread.is_alive() for thread in threads)
    exit_status = None
    if server is not None:
        server.send_signal(signal.SIGTERM)
        exit_status = server.wait(120)
    report(args, outcomes, failures, wall, timed_out, exit_status)
    if failures or timed_out or len(outcomes) != args.clients * args.requests:
        sys.exit(1)


def report(args, outcomes: list[Outcome], failures: list[str], wall: float, timed_out: bool,
           exit_status: int | None) -> None:
    sent = args.clients * args.requests
    print(f"{date.today()} · {platform.machine()}, {platform.system()}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[1]:.1f} over the last 5 min (a shared machine) · {args.clients} clients x "
          f"{args.requests} requests, max_tokens {args.max_tokens}, documents of ~{args.document_tokens} tokens, "
          f"model {args.model}")
    print(f"{len(outcomes)}/{sent} completed, {len(failures)} lost{', TIMED OUT' if timed_out else ''}; "
          f"{sum(o.retries for o in outcomes)} retries after 429; wall {wall:.1f} s; "
          f"server exit {exit_status if exit_status is not None else '-'} after SIGTERM")
    for failure in failures:
        print(f"  lost: {failure}")
    if not outcomes:
        return
    generated = sum(o.completion_tokens for o in outcomes)
    read = sum(o.prompt_tokens - o.cached_tokens for o in outcomes)
    cached = sum(o.cached_tokens for o in outcomes)
    print(f"throughput: {len(outcomes) / wall:.2f} requests/s, {generated / wall:.1f} generated tokens/s, "
          f"{read / wall:.0f} prompt tokens read/s ({cached} more from prefilled states)")
    print("\n| requests | n | prompt tokens (mean) | cached (mean) | first token s p50 / p90 / p99 | "
          "total s p50 / p90 / p99 |")
    print("|---|---|---|---|---|---|")
    for kind in ("document, read", "document, reused", "short", "all"):
        chosen = [o for o in outcomes if kind in ("all", o.kind)]
        if chosen:
            print(f"| {kind} | {len(chosen)} | {statistics.mean(o.prompt_tokens for o in chosen):.0f} | "
                  f"{statistics.mean(o.cached_tokens for o in chosen):.0f} | "
                  f"{percentiles([o.first_token for o in chosen])} | {percentiles([o.total for o in chosen])} |")


if __name__ == "__main__":
    main()
