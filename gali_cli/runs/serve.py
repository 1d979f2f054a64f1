"""gali serve: the model behind the OpenAI API until SIGTERM or Ctrl-C (gali_cli.server does the serving)."""

import os
from datetime import datetime

from ..display import say, warn
from ..estimate import FLOPS_PER_SECOND, free_memory, readable_tokens
from ..loading import LoadedModel
from ..server.app import ServerSettings, check_api_key
from ..server.guard import ANY, Reach
from ..server.run import address, bind
from ..server.run import serve as run_server
from ..server.worker import ModelWorker
from .choices import ModelChoice, Serving
from .common import entry_point, load, say_threads, store

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


@entry_point
def serve(choice: ModelChoice, serving: Serving) -> None:
    """Check the settings and take the port before the model loads (each fails at once), then serve."""
    method = choice.method
    choice.check()
    from_environment = serving.api_key is not None and serving.api_key == os.environ.get("GALI_API_KEY")
    check_api_key(serving.api_key, "GALI_API_KEY" if from_environment else "--api-key")  # the one the user set
    cache = None if serving.no_cache else store(serving.cache_dir)
    listener = bind(serving.host, serving.port)
    try:
        loaded = load(choice)
        worker = ModelWorker(loaded, method, choice.settings, cache, serving.queue_size)
        settings = ServerSettings(serving.model_name or choice.model, serving.api_key,
                                  serving.max_request_mib * 2**20, serving.max_new_tokens, serving.temperature,
                                  serving.top_p, Reach.for_bind(listener.getsockname()[0], serving.allow_hosts,
                                                                serving.allow_origins),
                                  max_prompt_tokens=serving.max_prompt_tokens or _readable(loaded))
        if not serving.api_key and serving.host not in LOCAL_HOSTS:
            warn(f"listening on {serving.host} without --api-key: anyone who can reach it can use the model")
        if not serving.api_key and ANY in serving.allow_origins:
            warn("--allow-origin '*' without --api-key: any web page you visit can use the model")
        window = (f"{worker.window}-token window" if worker.window == loaded.train_len else
                  f"{worker.window}-token window of --train-len, the model's {loaded.train_len}")
        say(f"gali serve: {settings.name} ({method}, {window}, prompts up to {settings.max_prompt_tokens:,} tokens) "
            f"at {address(listener)}/v1 (Ctrl-C stops)")
        say_threads()
        run_server(worker, settings, listener, _log)
    finally:
        listener.close()


def _readable(loaded: LoadedModel) -> int:
    """The default --max-prompt-tokens: what the device's free memory holds and it reads in estimate.READ_SECONDS."""
    return readable_tokens(loaded.model.config, loaded.stored_dtype.itemsize, free_memory(loaded.device),
                           FLOPS_PER_SECOND.get(loaded.device.type, FLOPS_PER_SECOND["cpu"]))


def _log(line: str) -> None:
    """An access-log line (or a note on stopping), timestamped, on stderr."""
    say(f"{datetime.now():%Y-%m-%d %H:%M:%S} {line}")
