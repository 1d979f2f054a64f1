"""gali info: the model, the machine and the settings, without loading weights, and without importing torch or
transformers where they are not needed to tell (machine.py, model_config.py): it answers at once."""

from .. import display
from ..config import PREVIEWED_METHODS
from ..errors import GaliError
from ..machine import environment_facts
from ..model_config import read_model_config
from . import ModelChoice


def show_info(choice: ModelChoice, json_output: bool) -> None:
    """What is known without the model, then its architecture and the settings GALI (and the other methods chosen,
    where they are known before the input) would use."""
    facts = {"model": choice.model, **environment_facts(choice.device, choice.dtype),
             "quantization": choice.quantize, "method": ",".join(choice.methods)}
    try:
        config = read_model_config(choice.model)
    except GaliError:
        display.print_facts(facts, json_output)  # what is known without the model, then the error
        raise
    gali = choice.settings.gali().resolved(config.train_len).facts()
    display.print_facts({**facts, **config.facts(), "gali": gali, **_previews(choice)}, json_output)


def _previews(choice: ModelChoice) -> dict:
    """The settings of the chosen methods whose settings follow the model's config (torch and transformers are
    imported for them only)."""
    previewed = [method for method in choice.methods if method in PREVIEWED_METHODS]
    if not previewed:
        return {}
    from ..loading import load_config
    from ..methods import preview_method

    config = load_config(choice.model)
    return {method: preview_method(config, method, choice.settings) for method in previewed}
