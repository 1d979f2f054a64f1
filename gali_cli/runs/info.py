"""gali info: the model, the machine and the settings, without loading weights, and without importing torch or
transformers where they are not needed to tell (machine.py, model_config.py): it answers at once."""

from .. import display
from ..errors import GaliError
from ..machine import environment_facts
from ..model_config import read_model_config
from . import ModelChoice


def show_info(choice: ModelChoice, json_output: bool) -> None:
    """What is known without the model, then its architecture and the GALI settings that would be used."""
    facts = {"model": choice.model, **environment_facts(choice.device, choice.dtype),
             "quantization": choice.quantize, "method": ",".join(choice.methods)}
    try:
        config = read_model_config(choice.model)
    except GaliError:
        display.print_facts(facts, json_output)  # what is known without the model, then the error
        raise
    gali = choice.settings.gali().resolved(config.train_len).facts()
    display.print_facts({**facts, **config.facts(), "gali": gali}, json_output)
