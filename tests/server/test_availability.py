"""gali serve stays available: no small request holds the model or the event loop for long (its work from request to
first token is linear in its size and bounded by the limits), a client that leaves frees its place at once, and a
connection that sends slowly or not at all is closed. The slow tier's soak test runs hostile clients against a
well-behaved one."""

import http.client
import json
import signal
import socket
import statistics
import threading
import time
from functools import partial
from types import SimpleNamespace
from urllib.parse import urlsplit

import openai
import pytest
from helpers.server import DOCUMENT, ask, client_for, long_answer, raw, serving, wait_until
from helpers.timing import scaled

from gali_cli.config import MethodSettings
from gali_cli.doc_cache import DocumentCache
from gali_cli.loading import load_model
from gali_cli.prompts import FREE_CUTS, MIN_CUT_GAP, served_parts, served_prompt
from gali_cli.server.app import ServerSettings
from gali_cli.server.connections import ConnectionLimits
from gali_cli.server.reuse import MAX_LOOKUPS, States
from gali_cli.server.worker import Job, ModelWorker, Sampling


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), "none", "cpu", "float32")


def chat(messages: list, **extra) -> dict:
    return {"model": "tiny", "messages": messages, "max_tokens": 2, **extra}


def parts(count: int, size: int = 8) -> list[dict]:
    return [{"type": "text", "text": f"{index:0{size}d}"} for index in range(count)]


def connect(server) -> socket.socket:
    address = urlsplit(server.url)
    return socket.create_connection((address.hostname, address.port), timeout=scaled(10))


def read_to_end(connection: socket.socket) -> bytes:
    """Everything the server sends on `connection` until it ends it; then the connection is closed."""
    answer = b""
    while chunk := connection.recv(65536):
        answer += chunk
    connection.close()
    return answer


def head(server, path: str, body: bytes | None = None) -> bytes:
    """A POST's request line and headers as a well-formed local client sends them (its Host, a JSON body), with the
    body after them when given; the caller may send the rest (or not) as slowly as it likes."""
    lines = f"POST {path} HTTP/1.1\r\nHost: {urlsplit(server.url).netloc}\r\nContent-Type: application/json\r\n"
    if body is None:
        return lines.encode()
    return lines.encode() + b"Content-Length: %d\r\n\r\n%s" % (len(body), body)


def closed_by_server(connection: socket.socket, seconds: float, trickle: bytes = b"") -> bool:
    """Whether the server closes `connection` within `seconds` (written for a quiet machine, scaled to this one's
    load) while the client sends `trickle` every 0.2 s."""
    deadline = time.monotonic() + scaled(seconds)
    connection.settimeout(0.2)
    while time.monotonic() < deadline:
        try:
            if connection.recv(65536) == b"":
                return True
        except TimeoutError:
            pass
        except OSError:  # reset
            return True
        try:
            if trickle:
                connection.sendall(trickle)
        except OSError:
            return True
    return False


# ---- limits on a request's size in messages and parts ------------------------------------------------------


def test_too_many_messages_or_parts_get_an_openai_400(loaded):
    with serving(loaded, max_messages=4, max_parts=6) as server:
        status, _, error = raw(server, "POST", "/v1/chat/completions",
                               chat([{"role": "user", "content": "Hi"}] * 5))
        assert status == 400 and error["error"]["param"] == "messages" and "4 messages" in error["error"]["message"]
        assert error["error"]["type"] == "invalid_request_error" and error["error"]["code"] == "too_many_messages"
        status, _, error = raw(server, "POST", "/v1/chat/completions",
                               chat([{"role": "user", "content": parts(4)}, {"role": "user", "content": parts(3)}]))
        assert status == 400 and error["error"]["code"] == "too_many_parts" and "6 text parts" in error["error"][
            "message"]
        assert raw(server, "POST", "/v1/chat/completions", chat([{"role": "user", "content": parts(6)}]))[0] == 200


def test_the_limits_default_whatever_gali_serve_passes_before_them():
    """runs/serve.py gives ServerSettings its first six fields by position: the limits come after, at their defaults."""
    settings = ServerSettings("m", None, 2**20, 7, 0.5, 0.9)
    assert (settings.max_new_tokens, settings.max_messages, settings.max_parts) == (7, 2048, 2048)
    assert settings.connections == ConnectionLimits(10.0, 60.0, 256)


def test_a_served_prompt_tokenizes_each_message_a_bounded_number_of_times(loaded):
    """500 parts of one message: the characters tokenized are a few times the prompt's, not 250 times."""
    tokenizer, seen = loaded.tokenizer, []

    class Counting:
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def __call__(self, text, **options):
            seen.append(len(text))
            return tokenizer(text, **options)

    from gali_cli.server.schemas import Message
    message = Message.model_validate({"role": "user", "content": parts(500)})
    served_prompt(Counting(), *served_parts(tokenizer, ["user"])[:1], [message.text], [message.cuts()])
    assert sum(seen) <= 6 * len(message.text)


def test_cuts_closer_than_the_minimum_gap_are_merged_so_forwards_stay_few(loaded):
    """2,048 one-character messages: one forward per message would cost a pass over the whole cache each (43 s on
    the tiny model); past the first FREE_CUTS, the cuts kept are MIN_CUT_GAP tokens apart at least, and depend only
    on what precedes them."""
    roles, texts = ["user"] * 2048, ["x"] * 2048
    template, bos = served_parts(loaded.tokenizer, roles)
    prompt = served_prompt(loaded.tokenizer, template, texts, [[]] * 2048, bos)
    gaps = [later - earlier for earlier, later in zip(prompt.cuts[FREE_CUTS - 1:-2], prompt.cuts[FREE_CUTS:-1])]
    assert prompt.cuts[-1] == len(prompt.ids) and min(gaps) >= MIN_CUT_GAP
    assert len(prompt.cuts) <= FREE_CUTS + len(prompt.ids) // MIN_CUT_GAP + 1
    longer = served_prompt(loaded.tokenizer, served_parts(loaded.tokenizer, [*roles, "user"])[0],
                           [*texts, "When?"], [[]] * 2049, bos)
    shared = prompt.shared
    assert [cut for cut in longer.cuts if cut <= shared] == [cut for cut in prompt.cuts if cut <= shared]


def test_a_huge_request_does_not_stall_the_event_loop(loaded):
    """64,000 one-character messages (2 MB) are refused without /health waiting for them."""
    body = json.dumps(chat([{"role": "user", "content": "x"}] * 64_000)).encode()
    with serving(loaded, max_body_bytes=2**23) as server:
        outcome: list = []
        thread = threading.Thread(target=lambda: outcome.append(raw(server, "POST", "/v1/chat/completions", body)))
        thread.start()
        slowest = 0.0
        while thread.is_alive():
            started = time.perf_counter()
            assert raw(server, "GET", "/health")[0] == 200
            slowest = max(slowest, time.perf_counter() - started)
            time.sleep(0.02)
        thread.join()
        assert outcome[0][0] == 400 and outcome[0][2]["error"]["code"] == "too_many_messages"
        assert slowest < scaled(0.5), f"/health waited {slowest:.2f} s"


def status_of(connection: socket.socket) -> tuple[int, dict]:
    """The status and JSON body of the response on `connection` (read until the server closes or sends it all)."""
    reply = b""
    while b"\r\n\r\n" not in reply or len(reply.split(b"\r\n\r\n", 1)[1]) < int(
            next((line.split(b":")[1] for line in reply.split(b"\r\n") if line.lower().startswith(b"content-length")),
                 b"0")):
        chunk = connection.recv(65536)
        if not chunk:
            break
        reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body or b"{}")


def test_a_full_queue_refuses_a_request_before_its_body_is_read(loaded):
    """With the queue full, a request is a 429 as soon as its headers are in: its (large) body is never read."""
    with serving(loaded, queue_size=1) as server:
        running = long_answer(server)
        waiting = threading.Thread(target=lambda: ask(client_for(server), "Hi", 2))
        waiting.start()
        assert wait_until(lambda: server.worker.waiting == 1)
        connection = connect(server)
        connection.sendall(head(server, "/v1/chat/completions") + b"Content-Length: %d\r\n\r\n" % (8 * 2**20))
        status, body = status_of(connection)  # no byte of the body sent
        assert status == 429 and body["error"]["code"] == "queue_full"
        connection.close()
        running.close()
        waiting.join(scaled(60))


def test_bodies_read_at_once_are_bounded_by_the_body_budget(loaded):
    """A body that would take the bytes being read past the budget is a 503 with Retry-After, at once; once the
    first is parsed, the budget is free again."""
    body = json.dumps(chat([{"role": "user", "content": "Hi " * 300}], max_tokens=1)).encode()
    with serving(loaded, body_budget_bytes=int(1.5 * len(body))) as server:
        first = connect(server)
        first.sendall(head(server, "/v1/chat/completions") + b"Content-Length: %d\r\n\r\n" % len(body))
        time.sleep(0.5)  # its declared length is held while its body comes
        second = raw(server, "POST", "/v1/chat/completions", body)
        assert second[0] == 503 and second[2]["error"]["code"] == "server_busy"
        first.sendall(body)
        assert status_of(first)[0] == 200
        first.close()
        assert raw(server, "POST", "/v1/chat/completions", body)[0] == 200


# ---- the model's thread: lookups bounded, cancellation checked -----------------------------------------------


def test_the_reuse_lookup_is_bounded_whatever_the_number_of_cuts(loaded, tmp_path, monkeypatch):
    store = DocumentCache(tmp_path, 2**30, lambda message: None)
    states, loads = States(loaded, "gali", store), []
    monkeypatch.setattr(DocumentCache, "load", lambda self, key, ids, model, kv_dtype: loads.append(key))
    from gali_cli.prompts import ServedPrompt
    ids = [index % 200 + 3 for index in range(6000)]
    prompt = ServedPrompt(ids, list(range(1, 6001)), 5999)
    states.start(prompt, {}, lambda: None)
    assert 0 < len(loads) <= MAX_LOOKUPS


def test_stopping_ends_a_huge_prompt_being_prepared_at_once(loaded, tmp_path):
    """3,000 messages: tokenizing them and looking for a stored state are cancelled between two steps."""
    store = DocumentCache(tmp_path, 2**30, lambda message: None)
    worker = ModelWorker(loaded, "gali", MethodSettings(), store, 2)
    roles, texts = ["user"] * 3000, [f"Message {index}." for index in range(3000)]
    template, bos = served_parts(loaded.tokenizer, roles)
    tokenize = partial(served_prompt, parts=template, texts=texts, text_cuts=[[]] * 3000, bos=bos)
    import asyncio
    loop = asyncio.new_event_loop()
    job = Job(tokenize, Sampling(2, 0.0, 1.0, 0), "huge", loop)
    worker.start()
    worker.submit(job)
    assert wait_until(lambda: worker.busy)
    time.sleep(0.3)
    stopped = time.perf_counter()
    worker.stop()
    assert worker.join(scaled(2.0)), "the worker went on preparing the prompt after the server stopped"
    assert time.perf_counter() - stopped < scaled(2.0)
    loop.close()


# ---- the queue: a client that leaves frees its place ------------------------------------------------------


def test_clients_that_leave_the_queue_free_their_places_at_once(loaded):
    with serving(loaded, queue_size=2) as server:
        running = long_answer(server)
        body = json.dumps(chat([{"role": "user", "content": "Hi"}], max_tokens=3)).encode()
        leaving = []
        for _ in range(2):  # two clients queue, then go away without a word
            connection = connect(server)
            connection.sendall(head(server, "/v1/chat/completions", body))
            leaving.append(connection)
        assert wait_until(lambda: server.worker.waiting == 2)
        for connection in leaving:
            connection.close()
        assert wait_until(lambda: server.worker.waiting == 0, 1), "gone clients kept their places in the queue"
        answers: list = []
        thread = threading.Thread(target=lambda: answers.append(ask(client_for(server), "Hi", 3)))
        thread.start()  # a live client queues instead of getting a 429
        assert wait_until(lambda: server.worker.waiting == 1)
        running.close()
        thread.join(scaled(60))
        assert answers[0].usage.completion_tokens == 3


# ---- connections: header and body timeouts, a bound on how many --------------------------------------------


def test_a_connection_that_sends_its_headers_slowly_is_closed(loaded):
    with serving(loaded, connections=ConnectionLimits(1.0, 1.0)) as server:
        silent, trickling = connect(server), connect(server)
        trickling.sendall(head(server, "/v1/chat/completions"))
        assert closed_by_server(trickling, 4, b"X-A: b\r\n"), "a slowloris connection stayed open"
        assert closed_by_server(silent, 1), "a silent connection stayed open"
        assert raw(server, "GET", "/health")[0] == 200


def test_a_connection_that_sends_its_body_slowly_is_closed(loaded):
    with serving(loaded, connections=ConnectionLimits(1.0, 1.0)) as server:
        trickling = connect(server)
        trickling.sendall(head(server, "/v1/chat/completions") + b"Content-Length: 1000\r\n\r\n{")
        assert closed_by_server(trickling, 4, b" "), "a connection trickling its body stayed open"
        assert wait_until(lambda: server.log and "499" in server.log[-1] and "before its body" in server.log[-1], 2)
        # a well-behaved client that waits for its answer longer than the timeouts keeps its connection
        answer = ask(client_for(server), f"{DOCUMENT}\n\nWho pays?", 40)
        assert answer.usage.completion_tokens == 40


def busy(server) -> socket.socket:
    """A connection with a request under way: its headers sent and read by the server, its body not yet."""
    watched = server.server.connections.connections
    under_way = sum(connection.idle_since is None for connection in watched)
    connection = connect(server)
    connection.sendall(head(server, "/v1/chat/completions") + b"Content-Length: 1000\r\n\r\n{")
    assert wait_until(lambda: sum(connection.idle_since is None for connection in watched) > under_way, 3)
    return connection


def test_connections_past_the_limit_are_refused_while_each_has_a_request_under_way(loaded):
    with serving(loaded, connections=ConnectionLimits(max_connections=3)) as server:
        held = [busy(server) for _ in range(3)]
        assert wait_until(lambda: raw_status(server) == 503, 3)
        for connection in held:
            connection.close()
        assert wait_until(lambda: raw_status(server) == 200, 3)


def test_one_address_holding_busy_connections_leaves_room_for_the_others(loaded):
    """Connections from one address fill that address's share only: a client on another address (127.0.0.2 is
    loopback too on Linux) is still served."""
    with serving(loaded, connections=ConnectionLimits(max_connections=8, max_per_address=3)) as server:
        held = [busy(server) for _ in range(3)]
        assert wait_until(lambda: raw_status(server) == 503, 3)
        assert raw_status(server, source="127.0.0.2") == 200
        for connection in held:
            connection.close()
        assert wait_until(lambda: raw_status(server) == 200, 3)


@pytest.mark.parametrize("limits", [ConnectionLimits(max_connections=8, max_per_address=3),
                                    ConnectionLimits(max_connections=3)], ids=["one address's", "the server's"])
def test_idle_connections_at_the_limit_are_shed_oldest_first_not_the_new_client(loaded, limits):
    """64 idle sockets from 127.0.0.1 refused every local client for 10 s at a time, renewable (on a loopback server
    every client has that address): at a limit, the connection idle the longest is closed to make room, and a
    client with its request under way is never shed (docs/serve.md, "Limits")."""
    with serving(loaded, connections=limits) as server:
        watched = server.server.connections.connections
        working = busy(server)
        idle = [connect(server) for _ in range(2)]
        for _ in range(3):  # renewed as soon as shed: each new client still gets in, shedding the oldest idle one
            assert wait_until(lambda: len(watched) == 3, 3)
            assert raw_status(server) == 200
            assert closed_by_server(idle.pop(0), 2)
            idle.append(connect(server))
        assert not closed_by_server(idle[0], 0.5) and not closed_by_server(working, 0.5)
        working.sendall(b" " * 999)  # its body, complete: a 400 (not a chat request), not a closed connection
        assert working.recv(65536).startswith(b"HTTP/1.1 400 ")


@pytest.mark.parametrize("size, pieces", [(17_000, 1), pytest.param(100_000, 1, marks=pytest.mark.slow), (17_000, 200)])
def test_headers_past_16_kib_are_a_431_whether_they_arrive_whole_or_in_pieces(served_small, size, pieces):
    request = head(served_small, "/v1/chat/completions", b"{}").replace(
        b"Content-Type", b"X-Padding: " + b"a" * size + b"\r\nContent-Type")
    connection = connect(served_small)
    step = -(-len(request) // pieces)
    for start in range(0, len(request), step):
        connection.sendall(request[start: start + step])
    answer = read_to_end(connection)
    assert answer.startswith(b"HTTP/1.1 431 ") and b"headers_too_large" in answer, answer[:200]
    assert raw_status(served_small) == 200


def test_a_431_reaches_a_client_that_goes_on_sending(served_small):
    """The server answers as soon as the headers pass the limit; a client still sending its request must read that
    answer, not a connection reset (closing with unread bytes resets it, and a reset discards what was not read
    yet), and the connection then closes."""
    request = head(served_small, "/v1/chat/completions", b"{}").replace(
        b"Content-Type", b"X-Padding: " + b"a" * 17_000 + b"\r\nContent-Type")
    connection = connect(served_small)
    connection.sendall(request)
    time.sleep(0.3)  # the 431 is sent meanwhile
    for _ in range(16):
        connection.sendall(b"b" * 4096)  # more of a request the server has stopped reading
    answer = read_to_end(connection)
    assert answer.startswith(b"HTTP/1.1 431 ") and b"headers_too_large" in answer, answer[:200]
    assert raw_status(served_small) == 200


def test_a_body_that_breaks_http_is_a_400_and_its_handler_hears_a_disconnect(served_small, caplog):
    """A chunked body whose framing is not HTTP: h11 fails inside the request, after its handler has started. The
    client reads the 400; the handler (/health answers without reading a body) is told the client is gone, so its
    answer goes nowhere instead of failing as an application error; the server goes on answering."""
    lines = head(served_small, "/health").replace(b"Content-Type", b"Transfer-Encoding: chunked\r\n"
                                                               b"Content-Type")
    connection = connect(served_small)
    connection.sendall(lines + b"\r\n" + b"4\r\n{\"a\"\r\nzz\r\n")  # a chunk, then a size that is no number
    answer = read_to_end(connection)
    assert answer.startswith(b"HTTP/1.1 400 ") and b"invalid_http" in answer, answer[:200]
    assert raw_status(served_small) == 200
    assert not [record for record in caplog.records if record.levelname == "ERROR"], caplog.text


@pytest.fixture(scope="module")
def served_small(loaded):
    with serving(loaded) as server:
        yield server


def raw_status(server, source: str | None = None) -> int:
    """The status of GET /health, from the local address `source` when given."""
    address = urlsplit(server.url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=scaled(10),
                                            source_address=(source, 0) if source else None)
    try:
        connection.request("GET", "/health")
        return connection.getresponse().status
    except (ConnectionError, OSError):
        return 0
    finally:
        connection.close()


# ---- the soak test --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_well_behaved_client_keeps_its_latency_while_hostile_clients_hammer_the_server(loaded):
    """Slowloris connections, requests with too many parts, clients that leave while queued: a small request keeps
    answering within its normal latency, and once they stop the server is idle again."""
    with serving(loaded, queue_size=8, connections=ConnectionLimits(2.0, 2.0, 64)) as server:
        client = client_for(server)

        def latency() -> float:
            started = time.perf_counter()
            assert ask(client, "The roof", 4).usage.completion_tokens == 4
            return time.perf_counter() - started

        normal = statistics.median(latency() for _ in range(5))
        stop = threading.Event()
        huge = json.dumps(chat([{"role": "user", "content": parts(5000, 30)}])).encode()
        queued = json.dumps(chat([{"role": "user", "content": f"{DOCUMENT} go"}], max_tokens=50)).encode()

        def slowloris() -> None:
            while not stop.is_set():
                try:
                    connection = connect(server)
                    connection.sendall(head(server, "/v1/completions"))
                    closed_by_server(connection, 3, b"X: y\r\n")
                    connection.close()
                except OSError:
                    time.sleep(0.1)

        def too_many_parts() -> None:
            while not stop.is_set():
                assert raw(server, "POST", "/v1/chat/completions", huge)[0] == 400

        def leaves_while_queued() -> None:
            while not stop.is_set():
                connection = connect(server)
                connection.sendall(head(server, "/v1/chat/completions", queued))
                time.sleep(0.3)
                connection.close()

        hostile = ([threading.Thread(target=slowloris) for _ in range(30)] + [threading.Thread(target=too_many_parts)]
                   + [threading.Thread(target=leaves_while_queued) for _ in range(3)])
        for thread in hostile:
            thread.start()
        try:
            time.sleep(1.0)
            under_attack = [latency() for _ in range(10)]
        finally:
            stop.set()
            for thread in hostile:
                thread.join(scaled(30))
        # the hostile requests that reached the model are cut short at once; those still queued leave with them
        assert wait_until(lambda: not server.worker.busy and server.worker.waiting == 0, 5)
        assert statistics.median(under_attack) < 3 * normal + scaled(1.0), (normal, under_attack)
        assert max(under_attack) < 5 * normal + scaled(2.0), (normal, under_attack)
        assert latency() < 3 * normal + scaled(1.0)
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts(5000)}])


@pytest.mark.slow
def test_sigterm_stops_gali_serve_promptly_while_it_prepares_and_reads_a_huge_prompt():
    """2,048 messages of 160 KB in all, read by the demo model: SIGTERM ends the process within seconds, and the
    client gets its error."""
    from helpers.server import gali_serve
    messages = [{"role": "user", "content": f"Line {index}: " + "word " * 16} for index in range(2048)]
    with gali_serve() as (url, process, lines):
        server = SimpleNamespace(url=url)
        outcome: list = []
        thread = threading.Thread(target=lambda: outcome.append(raw(server, "POST", "/v1/chat/completions", {
            "model": "demo", "messages": messages, "max_tokens": 2})))
        thread.start()
        assert wait_until(lambda: raw(server, "GET", "/health")[2]["busy"], 60)
        time.sleep(1.0)
        signalled = time.perf_counter()
        process.send_signal(signal.SIGTERM)
        assert process.wait(scaled(15)) == -signal.SIGTERM
        assert time.perf_counter() - signalled < scaled(10), "".join(lines)
        thread.join(scaled(10))
        assert outcome and outcome[0][0] == 503
