"""Imports every processor and saver module so their `@register_*` decorators fill the registries.

`core.config.load_practice` imports this before it parses a practice YAML. Add a line here for a new processor.
"""

import msmodelslim.processor.fa3_quant  # noqa: F401
import msmodelslim.processor.iter_smooth  # noqa: F401
import msmodelslim.processor.linear_quant  # noqa: F401
import msmodelslim.processor.quarot  # noqa: F401
import msmodelslim.processor.save.ascendv1_saver  # noqa: F401
