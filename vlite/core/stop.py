"""Token-level stop conditions, checked by the scheduler after each sampled token.

Stop *strings* need text, so the output processor checks them (vlite.engine.detokenizer).
"""

from __future__ import annotations

from vlite.core.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Set the request's finished status if its last token ends it; return whether it did.

    In order: the end-of-sequence token (unless ``ignore_eos``), a token listed in
    ``stop_token_ids`` (recorded as ``stop_reason``), then ``max_tokens`` or the model's
    context length. A token that is both EOS and the last allowed one reports "stop".
    Before ``min_tokens`` output tokens exist, neither EOS nor a stop token ends it.
    """
    params = request.sampling_params
    last_token_id = request.output_token_ids[-1]
    may_stop = request.num_output_tokens >= params.min_tokens
    if may_stop and not params.ignore_eos and last_token_id == request.eos_token_id:
        request.status = RequestStatus.FINISHED_STOPPED
    elif may_stop and last_token_id in params.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last_token_id
    elif request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    else:
        return False
    return True
