"""Request migration (--max-migrations): a streaming request whose worker (or PD pair) dies or hangs mid-stream
continues on another, which resumes after the tokens the client already has, with the same sampling state: the
engine counts them as its own output (engine.results.resume_req: lengths, penalties, the seeded draw's step, stop
strings, the grammar), so greedy and seeded outputs are exactly the unfailed ones. Not migrated: n > 1 on one worker
(PD splits n into single requests, which are), a stream whose last token already came, and past the limit; those
end with the error and the reason."""

from __future__ import annotations

from radixmesh.v1 import worker_pb2


class Streamed:
    """What a streaming request's client has received so far, for a migration: the tokens (a continuation resumes
    after them: same sampling state, engine.results.resume_req) and whether the last one ended the sample."""

    def __init__(self, request: worker_pb2.GenerateRequest):
        self.request = request
        self.tokens = list(request.resume_output_ids)
        self.chars = request.resume_text_chars  # of text the client got with them
        self.finished = False

    def saw(self, msg: worker_pb2.GenerateResponse) -> None:
        if msg.WhichOneof("response") == "chunk":
            self.tokens += msg.chunk.token_ids
            self.chars += len(msg.chunk.text)
            self.finished = self.finished or msg.chunk.HasField("finish_reason")

    def why_not_migrate(self, done: int, limit: int) -> str | None:
        if done >= limit:
            return f"after {done} of --max-migrations {limit}" if limit else "migration is off (--max-migrations 0)"
        if self.request.sampling_params.n > 1:
            return "a request with n > 1 is not migrated"
        if self.finished:
            return "it failed after its last token"
        return None

    def continuation(self) -> worker_pb2.GenerateRequest:
        out = worker_pb2.GenerateRequest()
        out.CopyFrom(self.request)
        out.resume_output_ids[:] = self.tokens
        out.resume_text_chars = self.chars
        return out
