"""vlite's built-in logits processors (``builtin`` registers them): ``logit_bias``,
``allowed_token_ids``, ``bad_words`` and ``min_tokens``, vLLM's meanings."""
