"""`msmodelslim eval`: perplexity of the original checkpoint and of its AscendV1 quantized output."""

from msmodelslim.eval.perplexity import EvalResult, cli_main, evaluate, layerwise_perplexity, wrap_quantized_linears

__all__ = ["EvalResult", "cli_main", "evaluate", "layerwise_perplexity", "wrap_quantized_linears"]
