"""Imports every processor and saver module so their `@register_*` decorators fill the registries, and hands the
registries to whoever parses a practice (`core.config.load_practice` takes them as arguments: core does not reach up
into processor/). Add a line here for a new processor.
"""

from collections.abc import Mapping
from typing import Any

import msmodelslim.processor.fa3_quant  # noqa: F401
import msmodelslim.processor.iter_smooth  # noqa: F401
import msmodelslim.processor.linear_quant  # noqa: F401
import msmodelslim.processor.quarot  # noqa: F401
import msmodelslim.processor.save.ascendv1_saver  # noqa: F401
from msmodelslim.processor.base import PROCESSORS  # noqa: E402 - after the registering imports
from msmodelslim.processor.save.base import SAVERS  # noqa: E402


def registries() -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    """(processors, savers): every processor and saver type a practice may name."""
    return PROCESSORS, SAVERS
