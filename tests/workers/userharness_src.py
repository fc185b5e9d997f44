"""Source of a harness in "the user's own code", written into a temporary directory by
the tests (so that no worker process can import it: it must travel pickled)."""

SOURCE = '''
import msgspec
import trio

from fleetrl.harness.builtin import CompletionHarness


class EchoingHarness:
    """The completion harness, after ``delay_s``; ``marker`` shows which instance arrived."""

    sandbox_use = "files"

    def __init__(self, max_tokens=6, temperature=1.0, marker="pickled-by-value", delay_s=0.0):
        self.inner = CompletionHarness(max_tokens=max_tokens, temperature=temperature)
        self.marker = marker
        self.delay_s = delay_s

    async def run(self, task, sandbox, model):
        await trio.sleep(self.delay_s)  # a harness that takes a while (tests kill a worker mid-run)
        return await self.inner.run(task, sandbox, model)


class StructHarness(msgspec.Struct, frozen=True):
    max_tokens: int = 6

    async def run(self, task, sandbox, model):
        return await CompletionHarness(max_tokens=self.max_tokens).run(task, sandbox, model)
'''
