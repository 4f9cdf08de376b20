"""Request migration (--max-migrations): a streaming request whose worker (or PD pair) dies or hangs mid-stream
continues on another, which resumes after the tokens the client already has, with the same sampling state: the
engine counts them as its own output (engine.results.resume_req: lengths, penalties, the seeded draw's step, stop
strings, the grammar), so greedy and seeded outputs are exactly the unfailed ones. A request with n > 1 continues as
one request per unfinished sample (sample j: seed + j, as the engine makes the samples, and its own tokens so far;
PD splits n that way from the start). Not migrated: a request whose every sample already ended, and past the limit;
those end with the error and the reason."""

from __future__ import annotations

from radixmesh.v1 import worker_pb2


def sample_request(request: worker_pb2.GenerateRequest, j: int) -> worker_pb2.GenerateRequest:
    """Sample j of an n > 1 request as a request of its own (as engine/results.py makes the colocated samples)."""
    out = worker_pb2.GenerateRequest()
    out.CopyFrom(request)
    out.request_id = f"{request.request_id}-{j}"
    out.sampling_params.ClearField("n")
    if out.sampling_params.HasField("sampling_seed"):
        out.sampling_params.sampling_seed += j
    return out


class Streamed:
    """What a streaming request's client has received so far, for a migration: per sample, the tokens (a
    continuation resumes after them: same sampling state, engine.results.resume_req), the characters of text that
    came with them, and whether the sample ended."""

    def __init__(self, request: worker_pb2.GenerateRequest):
        self.request = request
        self.n = max(request.sampling_params.n, 1) if request.sampling_params.HasField("n") else 1
        self.tokens = [list(request.resume_output_ids)] + [[] for _ in range(self.n - 1)]
        self.chars = [request.resume_text_chars] + [0] * (self.n - 1)
        self.ended = [False] * self.n

    @property
    def finished(self) -> bool:
        return all(self.ended)

    def saw(self, msg: worker_pb2.GenerateResponse) -> None:
        kind = msg.WhichOneof("response")
        if kind == "chunk":
            i = msg.index
            self.tokens[i] += msg.chunk.token_ids
            self.chars[i] += len(msg.chunk.text)
            if msg.chunk.HasField("finish_reason"):
                self.ended[i] = True
        elif kind == "complete":
            self.ended[msg.index] = True

    def why_not_migrate(self, done: int, limit: int) -> str | None:
        if done >= limit:
            return f"after {done} of --max-migrations {limit}" if limit else "migration is off (--max-migrations 0)"
        if self.finished:
            return "it failed after its last token"
        return None

    def unfinished(self) -> list[int]:
        return [j for j in range(self.n) if not self.ended[j]]

    def sample_continuation(self, j: int) -> worker_pb2.GenerateRequest:
        """Sample j of an n > 1 request, resuming after its tokens so far, as a request of its own."""
        out = sample_request(self.request, j)
        out.resume_output_ids[:] = self.tokens[j]
        out.resume_text_chars = self.chars[j]
        return out

    def continuation(self) -> worker_pb2.GenerateRequest:
        """The request (n = 1) resuming after the tokens the client has."""
        out = worker_pb2.GenerateRequest()
        out.CopyFrom(self.request)
        out.resume_output_ids[:] = self.tokens[0]
        out.resume_text_chars = self.chars[0]
        return out
