"""Request migration (--max-migrations): a streaming request whose worker (or PD pair) dies or hangs mid-stream
continues on another, which resumes after the tokens the client already has, with the same sampling state: the
engine counts them as its own output (engine.results.resume_req: lengths, penalties, the seeded draw's step, stop
strings, the grammar), so greedy and seeded outputs are exactly the unfailed ones. A request with n > 1 continues as
one request per unfinished sample (sample j: seed + j, as the engine makes the samples, and its own tokens so far;
PD splits n that way from the start). A request whose every sample had its last token when the worker failed is
not migrated: it ends as it would have, with the `complete` messages the worker did not send made from its chunks.
Past the limit a request ends with the error and the reason."""

from __future__ import annotations

from radixmesh.v1 import worker_pb2

_FOLD = 64  # Streamed keeps at most this many messages unread


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
    continuation resumes after them: same sampling state, engine.results.resume_req), the text that came with them,
    and whether the sample ended. `saw` runs for every message the router forwards, so it keeps only what is cheap
    to take from a message (upb field reads cost ~0.5-1.5k instructions each; a repeated field is copied through a
    slice, a third of what iterating it costs) and the rest is worked out when a stream breaks."""

    def __init__(self, request: worker_pb2.GenerateRequest):
        self.request = request
        self.n = n = max(request.sampling_params.n, 1)  # an unset n reads 0
        self._tokens = [request.resume_output_ids[:]]
        self._texts: list[list[str]] = [[]]  # the chunks' text
        self._last: list = [None]  # a sample's latest chunk (its finish reason says whether it ended)
        self._completed = [False]  # the worker's `complete` arrived
        if n > 1:
            self._tokens += [[] for _ in range(n - 1)]
            self._texts += [[] for _ in range(n - 1)]
            self._last, self._completed = self._last * n, self._completed * n
        self._seen: list = []  # messages not folded into the above yet

    def saw(self, msg: worker_pb2.GenerateResponse) -> None:
        """Runs for every message the router forwards: it only keeps the message; what a migration needs is read
        from the messages when it is asked for, or every _FOLD messages (so a long stream holds few)."""
        seen = self._seen
        seen.append((msg.index, msg))  # (the index as it is now: callers above may renumber the message later)
        if len(seen) >= _FOLD:
            self._fold()

    def _fold(self) -> None:
        for i, msg in self._seen:
            if msg.HasField("chunk"):
                chunk = msg.chunk
                self._tokens[i] += chunk.token_ids[:]
                self._texts[i].append(chunk.text)
                self._last[i] = chunk
            elif msg.HasField("complete"):
                self._completed[i] = True
        self._seen.clear()

    @property
    def tokens(self) -> list[list[int]]:
        """Per sample, the token ids the client has (a continuation's resumed ones first)."""
        self._fold()
        return self._tokens

    @property
    def texts(self) -> list[list[str]]:
        self._fold()
        return self._texts

    @property
    def last(self) -> list:
        self._fold()
        return self._last

    @property
    def completed(self) -> list[bool]:
        self._fold()
        return self._completed

    @property
    def ended(self) -> list[bool]:
        return [done or (last is not None and last.HasField("finish_reason"))
                for done, last in zip(self.completed, self.last)]

    @property
    def finished(self) -> bool:
        return all(self.ended)

    @property
    def chars(self) -> list[int]:
        """Characters of text the client has per sample (a continuation's own resumed ones included)."""
        out = [sum(map(len, texts)) for texts in self.texts]
        out[0] += self.request.resume_text_chars
        return out

    def completes(self) -> list[worker_pb2.GenerateResponse]:
        """For a stream whose every sample finished (`finished`) before its worker failed: the `complete` messages
        the worker did not send, made from the chunks the client has (every token, the whole text, the finishing
        chunk's reason and running totals). The text is whole only where the stream started here: a continuation
        that was not migrated in this router lacks the text before `resume_text_chars` (its tokens are there)."""
        out = []
        for i in range(self.n):
            chunk = self.last[i]
            if self.completed[i] or chunk is None or not chunk.HasField("finish_reason"):
                continue
            complete = worker_pb2.GenerateComplete(output_ids=self.tokens[i], text="".join(self.texts[i]),
                                                   finish_reason=chunk.finish_reason)
            complete.usage.prompt_tokens = chunk.prompt_tokens
            complete.usage.completion_tokens = chunk.completion_tokens
            complete.usage.cached_tokens = chunk.cached_tokens
            if chunk.HasField("spec"):
                complete.usage.spec.CopyFrom(chunk.spec)
            out.append(worker_pb2.GenerateResponse(request_id=self.request.request_id, index=i, complete=complete))
        return out

    def why_not_migrate(self, done: int, limit: int) -> str | None:
        if done >= limit:
            return f"after {done} of --max-migrations {limit}" if limit else "migration is off (--max-migrations 0)"
        return None

    def unfinished(self) -> list[int]:
        return [j for j, ended in enumerate(self.ended) if not ended]

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
