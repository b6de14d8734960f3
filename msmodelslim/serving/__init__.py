"""The serving target: what the output is written as (AscendV1) and the rules of the engine that loads it
(profiles per vllm-ascend line, fused-layer tables, the checks of a linear plan), as data with their sources."""
