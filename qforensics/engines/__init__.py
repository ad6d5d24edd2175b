"""Engine adapters: what a step, a request, the logits and a warm-up forward are inside a serving
engine. `vllm` attaches capture where vLLM's worker builds the model (its model runner's
`load_model`), in every worker process, one trace file per rank."""
