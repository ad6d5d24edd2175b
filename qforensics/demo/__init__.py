"""The project's main job on a real model: SmolLM2-135M quantization scenarios (optional extra
`qforensics[demo]`; the core tool never imports this package)."""
