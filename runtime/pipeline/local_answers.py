"""A local backend's answers through the async seam (`models/lm/answering.py`): each call a device-worker job.

Function calls on a local model whose chat template takes tools (Qwen2.5's: `models/lm/tool_calls.py`): the backend
renders the tools and the exchange of calls in the template's own format and decodes a call as the template writes
it, under a grammar (`tools=`); the model decides under `auto`. The answer's text is then either text or one call,
which `CallText` turns into the call's name and argument pieces.

Other models (SmolLM2's template ignores tools): a call is forced (`tool_choice` names a function, or is
`required`) and its arguments are decoded under the function's JSON Schema (the backend's `schema=`), so the call
is valid JSON even from a 135M model. Under `required` with several tools the model first chooses the name, decoded
under an enum of the names, then writes that function's arguments. With `auto` such a model answers in text.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from runtime.events import new_id
from runtime.function_tools import ToolUse, arguments_schema, names_schema, tools_prompt
from runtime.models.lm.answering import AnswerRequest, CallDelta, RunningAnswer, Step
from runtime.models.lm.backend import Answer, AnswerBackend, AnswerStep, DecodingStats, LMStream
from runtime.models.lm.tool_calls import CallText, ToolFormat, ToolPrompt
from runtime.models.tts.clauses import ClauseSplitter
from runtime.worker import DeviceWorker, Priority, Together, WorkerStopped

# a prepared answer's steps decoded during the pause, at most: a first clause is 3-6 words (`ClauseRules`), 1-2 tokens
# each, a drafted step one or more of them
STEPS_AHEAD = 12


class OnWorker:
    """A local backend's answers, each call a job on the device worker (model compute never runs on the loop).

    Prepared answers: `prepare` starts a plain answer (no tools) at once and decodes its opening ahead (`_Ahead`: its
    steps until a first clause is written, at most `steps_ahead`), and the next `start` with the very same request
    takes it as it was started, the steps decoded so far replayed first; a different request, or `drop_prepared`,
    stops the steps and releases it. The answer's view of the context is frozen when it starts (the engine's target
    group), so the prefill that goes on meanwhile changes nothing: a prepared answer is the answer that `start` would
    have given then, step for step. One at a time: a stream holds one open answer, so every release finishes before
    another start. Steps ahead once lost (voice-to-voice 1.09 s against 0.98-1.05 s without: they held the one worker
    when the turn's last chunk came); with ASR on its own worker thread they no longer stand in its way
    (docs/model_card_piper_joe.md)."""

    def __init__(self, backend: AnswerBackend, worker: DeviceWorker, stream: LMStream | None = None,
                 steps_ahead: int = STEPS_AHEAD) -> None:
        self.backend, self.worker, self.stream, self.steps_ahead = backend, worker, stream, steps_ahead
        # a backend whose answers' steps share forwards (the engine's): each step goes through it
        self.together: Together[Answer, AnswerStep] | None = getattr(backend, "step_together", None)
        self.prepared_used = 0  # starts that found their answer prepared
        self.prepared_dropped = 0
        self.steps_decoded_ahead = 0  # steps of prepared answers decoded before their start (used or not)
        self.steps_withdrawn = 0  # steps ahead still queued when their answer started: taken by it at OPENING
        self._prepared: tuple[AnswerRequest, _Ahead, asyncio.Task[Answer]] | None = None
        self._releasing: set[asyncio.Task[None]] = set()

    def prepare(self, request: AnswerRequest) -> None:
        self.drop_prepared()
        if not request.tools.tools:
            ahead = _Ahead()
            self._prepared = (request, ahead, asyncio.ensure_future(self._open_ahead(request, ahead)))

    async def _open_ahead(self, request: AnswerRequest, ahead: _Ahead) -> Answer:
        answer = await self._open(request.context, request.question, request.max_tokens)
        opening = ClauseSplitter()
        try:
            while not ahead.stop and len(ahead.steps) < self.steps_ahead:
                # below the openings and prefills of answers a user already waits for; taken, it goes on at OPENING
                # (one step of each conversation's queued at a time: outside the worker's slots, which bound the
                # jobs a user waits for)
                queued = ahead.queued = _submit(self.worker, Priority.DECODE, answer, self.together)
                try:
                    step = await asyncio.wrap_future(queued)
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if ahead.stop and queued.cancelled() and not (task and task.cancelling()):
                        break  # withdrawn by the start before it ran: not decoded
                    raise
                finally:
                    ahead.queued = None
                ahead.steps.append(step)
                self.steps_decoded_ahead += 1
                if step.done or opening.push(step.delta):
                    break
        except BaseException:  # a failed step, or the task cancelled (the loop closing): what it opened is released
            with contextlib.suppress(WorkerStopped):
                self.worker.submit(Priority.CONTROL, answer.release)
            raise
        return answer

    def drop_prepared(self) -> None:
        prepared, self._prepared = self._prepared, None
        if prepared is not None:
            self.prepared_dropped += 1
            prepared[1].withdraw()
            task = asyncio.ensure_future(self._release(prepared[2]))
            self._releasing.add(task)
            task.add_done_callback(self._releasing.discard)

    async def _release(self, started: asyncio.Task[Answer]) -> None:
        try:
            answer = await started
        except (Exception, asyncio.CancelledError):  # it failed to start (or was cancelled): nothing is open
            return
        await self.worker.run(Priority.CONTROL, answer.release)

    async def start(self, request: AnswerRequest) -> RunningAnswer:
        prepared = self._prepared
        if prepared is not None and prepared[0] == request:
            self._prepared = None
            _, ahead, task = prepared
            # a step running finishes; one still queued below other conversations' jobs is withdrawn, and with the
            # rest is the answer's own, at its priority (OPENING)
            self.steps_withdrawn += ahead.withdraw()
            try:  # shielded: a cancelled start leaves the preparation running, and its release awaits it
                answer = await asyncio.shield(task)
            except asyncio.CancelledError:  # (the session stops) what it started is still released
                self._prepared = prepared
                self.drop_prepared()
                raise
            except Exception:  # a failed preparation (released): started again below, which reports its own error
                pass
            else:
                self.prepared_used += 1
                return WorkerAnswer(answer, self.worker, together=self.together, replay=deque(ahead.steps))
        self.drop_prepared()
        if self._releasing:
            await asyncio.gather(*self._releasing, return_exceptions=True)
        use = request.tools
        fmt: ToolFormat | None = getattr(self.backend, "tool_format", None)
        if fmt is not None and use.tools:  # the model's own format: the calls go in as messages, not context lines
            context = request.context_before_calls if request.calls else request.context
            answer = await self.worker.run(Priority.PREFILL, self.backend.start, context, request.question,
                                           stream=self.stream, max_tokens=request.max_tokens,
                                           tools=ToolPrompt(use, request.calls))
            return WorkerAnswer(answer, self.worker, call_text=CallText(fmt), together=self.together)
        if not use.active or (use.forced is None and use.choice != "required"):
            answer = await self._open(request.context, request.question, request.max_tokens)
            return WorkerAnswer(answer, self.worker, together=self.together)
        name = use.forced or await self._choose(request, use)
        tool = use.tool(name)  # only the function called is described: the question's token budget is small
        question = (f"{request.question}\n\n{tools_prompt(ToolUse((tool,)))}\n"
                    f"Call {name}: write its arguments as one JSON object.")
        answer = await self._open(request.context, question, request.max_tokens, schema=arguments_schema(tool))
        return WorkerAnswer(answer, self.worker, call=CallDelta(0, new_id("call"), name, ""),
                            together=self.together)

    async def _open(self, context: str, question: str, max_tokens: int | None,
                    schema: dict[str, object] | None = None) -> Answer:
        if schema is None:
            return await self.worker.run(Priority.PREFILL, self.backend.start, context, question, stream=self.stream,
                                         max_tokens=max_tokens)
        return await self.worker.run(Priority.PREFILL, self.backend.start, context, question, stream=self.stream,
                                     max_tokens=max_tokens, schema=schema)

    async def _choose(self, request: AnswerRequest, use: ToolUse) -> str:
        """`required` among several tools: the model names one, decoded under an enum of the names."""
        question = f"{request.question}\n\n{tools_prompt(use)}\nWhich function answers this? Give its name."
        # a name may take a token a character; its quotes and the end two more
        longest = max(len(t.name) for t in use.tools)
        answer = await self._open(request.context, question, longest + 4, schema=names_schema(use))
        running = WorkerAnswer(answer, self.worker, together=self.together)
        text = ""
        try:
            while not (step := await running.step()).done:
                text += step.text
            text += step.text
        finally:
            await running.close()
        try:
            name = json.loads(text)
        except json.JSONDecodeError:
            name = None
        if not isinstance(name, str) or all(t.name != name for t in use.tools):
            raise ValueError(f"the model chose no declared function ({text!r})")
        return name


@dataclass(eq=False)
class _Ahead:
    """A prepared answer's steps decoded before its start; `withdraw` ends them."""

    steps: list[AnswerStep] = field(default_factory=list)
    stop: bool = False
    queued: Future[AnswerStep] | None = None  # the step submitted to the worker and not yet done

    def withdraw(self) -> bool:
        """No more steps: one running finishes (its step is kept), one not yet started is withdrawn from the
        worker's queue (True). At a start it waited at DECODE, below the other conversations' openings, prefills
        and speech; the answer takes it at OPENING."""
        self.stop = True
        return self.queued is not None and self.queued.cancel()


def _submit(worker: DeviceWorker, priority: Priority, answer: Answer,
            together: Together[Answer, AnswerStep] | None) -> Future[AnswerStep]:
    if together is not None:
        return worker.submit_together(priority, together, answer)
    return worker.submit(priority, answer.step)


async def _step(worker: DeviceWorker, priority: Priority, answer: Answer,
                together: Together[Answer, AnswerStep] | None) -> AnswerStep:
    if together is not None:
        return await worker.run_together(priority, together, answer)
    return await worker.run(priority, answer.step)


@dataclass(eq=False)
class WorkerAnswer:
    """A local answer: each step a worker job. With `call`, its text is that call's arguments."""

    answer: Answer
    worker: DeviceWorker
    call: CallDelta | None = None
    closed: bool = False
    call_text: CallText | None = None  # a tool-taking template's answer: text, or a call if it opens with one
    together: Together[Answer, AnswerStep] | None = None  # its backend's steps of several answers in one forward
    # the answer's opening, until a first clause is written (the rule a voice cuts it by): its steps run at
    # `Priority.OPENING`, ahead of other conversations' question prefills; then at DECODE. None once it is written
    opening: ClauseSplitter | None = field(default_factory=ClauseSplitter)
    replay: deque[AnswerStep] = field(default_factory=deque)  # its steps decoded ahead (`OnWorker.prepare`), first

    @property
    def prompt_tokens(self) -> int:
        return len(self.answer.prompt_ids)

    @property
    def priority(self) -> Priority:
        """Where its next step queues on the worker."""
        return Priority.OPENING if self.opening is not None else Priority.DECODE

    async def step(self) -> Step:
        step = self.replay.popleft() if self.replay else await _step(self.worker, self.priority, self.answer,
                                                                      self.together)
        if self.opening is not None and self.opening.push(step.delta):
            self.opening = None
        parse = self.call_text
        # a call's first token is the opener (the constraint forbids it anywhere else): any other start is text
        if (parse is not None and self.call is None and (parse.text or step.delta)
                and not (parse.text + step.delta).startswith(parse.fmt.opener)):
            self.call_text = parse = None
        if parse is not None:
            arguments = parse.feed(step.delta)
            if self.call is None and parse.name is not None:
                self.call = CallDelta(0, new_id("call"), parse.name, "")
            if self.call is None:  # the opener and the name so far
                return Step(done=step.done, finish_reason=step.finish_reason, tokens=step.tokens)
            piece = CallDelta(self.call.index, self.call.call_id, self.call.name, arguments)
            return Step(call=piece, done=step.done, finish_reason=step.finish_reason, tokens=step.tokens)
        if self.call is None:
            return Step(text=step.delta, done=step.done, finish_reason=step.finish_reason, tokens=step.tokens)
        piece = CallDelta(self.call.index, self.call.call_id, self.call.name, step.delta)
        return Step(call=piece, done=step.done, finish_reason=step.finish_reason, tokens=step.tokens)

    async def close(self) -> DecodingStats | None:
        if self.closed:
            return None
        self.closed = True
        stats = await self.worker.run(Priority.CONTROL, self.answer.stats)
        await self.worker.run(Priority.CONTROL, self.answer.release)
        return stats
