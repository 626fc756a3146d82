"""Hand-made trajectories over a three-page corpus, with real browser observations, and the counts the rubric gives
each step (credit-spec.md section 3, first-revealed rule). Shared by the judge tests."""

from trace_jax.abc.scorer import Step, StepCounts
from trace_jax.envs.browser import Browser
from trace_jax.envs.corpus import Corpus
from trace_jax.envs.tasks import Clue

DOCS = [
    {"docid": "d1", "url": "https://wiki.example/alpha", "title": "Alpha river",
     "text": "The Alpha river flows through Paris. It is long and slow."},
    {"docid": "d2", "url": "https://wiki.example/beta", "title": "Beta city",
     "text": "Beta city lies on the Alpha river. Its mayor is Lina Voss."},
    {"docid": "d3", "url": "https://wiki.example/gamma", "title": "Gamma",
     "text": "Gamma is a company, not a city. It was founded in 1990."},
]
QUESTION = "Which city does the river that Beta city lies on flow through?"
GOLD = ["Paris", "Paris, France"]
CLUES = (Clue("d2", "Beta city", "lies_on", "Alpha river"),
         Clue("d1", "Alpha river", "flows_through", "Paris"),
         Clue("d3", "Gamma", "type", "a company", kind="exclude"))


def _call(name, arguments):
    import json

    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


class _Agent:
    def __init__(self):
        self.browser = Browser(Corpus.from_records(DOCS))
        self.steps = []

    def tool(self, name, arguments):
        observation = self.browser.step(name, arguments)
        self.steps.append(Step(assistant=_call(name, arguments), observation=observation.text,
                               tool_call=(name, arguments)))
        return observation

    def open_result(self, docid):
        link = self.browser.current_page.link_for(docid)
        assert link is not None, f"{docid} is not among the search results"
        return self.tool("open", {"id": link})

    def answer(self, text):
        self.steps.append(Step(assistant=f"I am done. <answer>{text}</answer>"))
        return self.steps


def trajectories():
    """[(name, steps, expected counts per step as (n_found, n_excluded, n_rejected, ans))]."""
    out = []
    a = _Agent()  # solves it, with a detour through an excluded candidate and a re-read
    a.tool("search", {"query": "Beta city river"})
    a.open_result("d2")
    a.tool("search", {"query": "Gamma company"})
    a.open_result("d3")
    a.tool("search", {"query": "Alpha river"})
    a.open_result("d1")
    a.tool("search", {"query": "Beta city"})
    a.open_result("d2")
    out.append(("correct", a.answer("Paris"),
                [(0, 0, 0, 0), (1, 0, 0, 0), (0, 0, 0, 0), (0, 1, 0, 0), (0, 0, 0, 0), (1, 0, 0, 0), (0, 0, 0, 0),
                 (0, 0, 0, 0), (0, 0, 0, 1)]))
    b = _Agent()  # reads the answer on its page, then answers something else
    b.tool("search", {"query": "Alpha river"})
    b.open_result("d1")
    out.append(("rejected", b.answer("Lyon"), [(0, 0, 0, 0), (1, 0, 0, 0), (0, 0, 1, -1)]))
    c = _Agent()  # cut off after two tool calls: no answer step, so it failed (ans = no_answer = -1 by default)
    c.tool("search", {"query": "Gamma"})
    c.open_result("d3")
    out.append(("cut_off", c.steps, [(0, 0, 0, 0), (0, 1, 0, -1)]))
    d = _Agent()  # answers at once, wrongly, having seen nothing
    out.append(("guess", d.answer("Rome"), [(0, 0, 0, -1)]))
    return out


def as_tuples(counts):
    return [(c.n_found, c.n_excluded, c.n_rejected, c.ans) for c in counts]


def neutral(counts: StepCounts) -> bool:
    return (counts.n_found, counts.n_excluded, counts.n_rejected) == (0, 0, 0)


def scripted_recovery_reply(request):
    """A scripted clue-recovery agent: search the answer, open its page, search the linking entity, open it, then
    report the two support clues plus one whose value is not on its page (verification must drop it)."""
    import json
    import re

    tool_messages = [m for m in request["messages"] if m["role"] == "tool"]

    def open_link(title):
        link = re.search(r"【(\d+)†" + re.escape(title) + "†", tool_messages[-1]["content"])
        return _call("open", {"id": int(link.group(1))})

    plan = [lambda: _call("search", {"query": "Paris"}), lambda: open_link("Alpha river"),
            lambda: _call("search", {"query": "Beta city"}), lambda: open_link("Beta city")]
    if len(tool_messages) < len(plan):
        return plan[len(tool_messages)]()
    return json.dumps({"clues": [
        {"url": "https://wiki.example/alpha", "relation": "flows_through", "value": "Paris"},
        {"url": "https://wiki.example/beta", "relation": "lies_on", "value": "Alpha  river"},
        {"url": "https://wiki.example/gamma", "relation": "mayor", "value": "Lina Voss"}]})


def scripted_judge_and_agent(request):
    """One scripted model that is the recovery agent when given the recovery prompt, else the rubric judge."""
    from trace_jax.abc.judge import scripted_rubric_reply
    from trace_jax.abc.recover import RECOVERY_PROMPT

    if request["messages"] and request["messages"][0].get("content") == RECOVERY_PROMPT:
        return scripted_recovery_reply(request)
    return scripted_rubric_reply(request)


def to_messages(steps, question=QUESTION):
    """A `trace-jax credit` record's messages for the steps (tool calls as OpenAI tool_calls)."""
    import json

    messages = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": question}]
    for k, step in enumerate(steps):
        if step.tool_call is not None:
            name, arguments = step.tool_call
            messages.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{k}", "type": "function",
                 "function": {"name": name, "arguments": json.dumps(arguments)}}]})
            messages.append({"role": "tool", "tool_call_id": f"call_{k}", "content": step.observation})
        else:
            messages.append({"role": "assistant", "content": step.assistant})
    return messages
