"""Reward scoring: every source, failures as None, and start-up checks of the reward flags.

Proves that the flags pick the right scorer (math, exact, the built-in task's
reward, a custom sync / async / per-group function that receives ``args``, a
remote HTTP service); that a function that raises, times out or returns NaN /
a string / None yields None for that sample (a whole group for --group-rm)
and is counted with its message, never raised; that a rule-based reward
given no label fails the sample instead of matching the text "None", and
``reward_needs_label`` says which rewards need one; that the math scorer takes
a list label (verl-style data) as any-of and scores a response cut off inside
``<think>`` 0, and is refused at start-up, naming the install line, where
math-verify is not installed; that the remote client retries 500s until success, does not
retry a 400, gives up on a server that never answers or a closed port, and under load
against a service failing a third of its requests scores every sample once, with the
score its key was given, or masks and counts it after its last retry; that
``score_sync`` works inside a running event loop; and that bad reward flags
(unimportable or wrongly shaped function, no reward for file data,
conflicting flags) fail in ``parse_args`` with a one-line ConfigError naming
the culprit. The remote service is a real local HTTP server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.cpu.test_rollout_manager import IDENTITY_ADVANTAGE, _setup
from vime.algo.custom import load_function
from vime.config import ConfigError, parse_args
from vime.config.rollout_settings import reward_settings
from vime.data.tasks import CHARSET
from vime.models.embedded import build_tokenizer
from vime.rollout.rewards import (
    RewardError,
    RewardInput,
    build_reward_scorer,
    exact_reward,
    reward_needs_label,
)


def _scorer(args, task_reward=None, **kwargs):
    """The run's scorer for ``args``: its reward settings, the flags handed to a hook."""
    return build_reward_scorer(reward_settings(args), task_reward, hook_args=args, **kwargs)


HOOKS = textwrap.dedent(
    """
    import asyncio
    import math
    import threading

    RELEASE = threading.Event()

    def length(args, sample):
        return float(len(sample.response))

    async def async_length(args, sample):
        await asyncio.sleep(0)
        return len(sample.response)

    def uses_args(args, sample):
        return args.rm_timeout

    def picky(args, sample):
        if sample.response == "boom":
            raise ValueError("boom!")
        return {"nan": math.nan, "str": "1.0", "none": None, "bool": True}.get(
            sample.response, 2.0
        )

    async def async_boom(args, sample):
        raise RuntimeError("async boom")

    def slow(args, sample):
        if sample.response == "slow":
            RELEASE.wait(30)
        return 1.0

    async def slow_async(args, sample):
        if sample.response == "slow":
            await asyncio.sleep(30)
        return 1.0

    def group_offsets(args, samples):
        return [10.0 * s.group + len(s.response) for s in samples]

    async def group_fails_odd(args, samples):
        if samples[0].group % 2:
            raise RuntimeError("odd group")
        return [1.0, math.inf][: len(samples)]

    def group_too_short(args, samples):
        return [1.0]

    def one_param(sample):
        return 1.0
    """
)


@pytest.fixture(scope="module")
def hooks(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("hooks") / "reward_hooks.py"
    path.write_text(HOOKS)
    return str(path)


def _samples(*responses: str, groups: list[int] | None = None) -> list[RewardInput]:
    groups = groups or [0] * len(responses)
    return [
        RewardInput(prompt="p", response=r, label=0, metadata={"w": 0.25}, group=g)
        for r, g in zip(responses, groups, strict=True)
    ]


def _custom(hooks: str, fn: str, *extra: str):
    return _scorer(parse_args(["--custom-rm-path", f"{hooks}:{fn}", *extra]))


# ---------------------------------------------------------------- rule-based


def test_math_exact_and_task_rewards() -> None:
    samples = [
        RewardInput("q", r"so \boxed{1/2}", "0.5", {}, 0),
        RewardInput("q", "it is 3", "4", {}, 0),
    ]
    math_scorer = _scorer(parse_args(["--rm-type", "math"]))
    assert math_scorer.score_sync(samples) == [1.0, 0.0]
    assert exact_reward("  abc\n", "abc") == 1.0 and exact_reward("abd", "abc") == 0.0
    exact = _scorer(parse_args(["--rm-type", "exact"]))
    assert exact.score_sync([RewardInput("q", " 4 ", 4, {}, 0)]) == [1.0]
    # No --prompt-data means the built-in task: its reward is used when handed over.
    task = _scorer(parse_args([]), task_reward=lambda r, label: float(r == label[::-1]))
    assert task.score_sync([RewardInput("q", "cba", "abc", {}, 0)]) == [1.0]
    with pytest.raises(ConfigError, match="--rm-type math"):
        _scorer(parse_args([]))


def test_rule_rewards_without_a_label_fail() -> None:
    """str(None) == "None": without the check a response "None" would score 1.0."""
    with pytest.raises(RewardError, match="no label to compare with"):
        exact_reward("None", None)
    assert exact_reward("None", "None") == 1.0  # a real label "None" still matches
    responses = ["None", r"\boxed{None}", "4"]
    for rm_type in ("math", "exact"):
        scorer = _scorer(parse_args(["--rm-type", rm_type]))
        samples = [RewardInput("q", r, None, {}, 0) for r in responses]
        assert scorer.score_sync([*samples, RewardInput("q", "4", "4", {}, 0)]) == [
            None,
            None,
            None,
            1.0,
        ], rm_type
        assert scorer.last_failure_count == 3
        assert scorer.last_failures[0] == (
            "sample 0: the prompt has no label to compare with (see --label-key)"
        )
    task = _scorer(parse_args([]), task_reward=lambda r, label: 1.0)
    assert task.score_sync([RewardInput("q", "x", None, {}, 0)]) == [None]


def test_math_scorer_list_labels_and_think_blocks() -> None:
    """A list label is not compared as its text "['72']"; an unfinished think has no answer."""
    scorer = _scorer(parse_args(["--rm-type", "math"]))
    samples = [
        RewardInput("q", r"\boxed{72}", ["72"], {}, 0),
        RewardInput("q", r"\boxed{72}", ["71", "73"], {}, 0),
        RewardInput("q", "<think>it is 72</think>\nAnswer: 72", "72", {}, 0),
        RewardInput("q", r"<think>so \boxed{72}, wait", "72", {}, 0),
        RewardInput("q", r"\boxed{72}", [], {}, 0),
    ]
    assert scorer.score_sync(samples) == [1.0, 0.0, 1.0, 0.0, None]
    assert "needs a label" in scorer.last_failures[0]


def test_which_rewards_need_a_label(hooks: str, tmp_path) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1", "label": "2"}\n')
    file_data = ["--prompt-data", str(data)]
    assert reward_needs_label(reward_settings(parse_args([*file_data, "--rm-type", "math"])))
    assert reward_needs_label(reward_settings(parse_args([*file_data, "--rm-type", "exact"])))
    assert reward_needs_label(reward_settings(parse_args([])))  # the built-in task's reward
    assert not reward_needs_label(
        reward_settings(parse_args([*file_data, "--custom-rm-path", f"{hooks}:length"]))
    )
    assert not reward_needs_label(
        reward_settings(parse_args([*file_data, "--rm-url", "http://localhost:1/"]))
    )


# ---------------------------------------------------------------- custom


def test_custom_sync_and_async_functions(hooks: str) -> None:
    assert _custom(hooks, "length").score_sync(_samples("ab", "abcd")) == [2.0, 4.0]
    assert _custom(hooks, "async_length").score_sync(_samples("abc")) == [3.0]
    assert _custom(hooks, "uses_args", "--rm-timeout", "7").score_sync(_samples("x")) == [7.0]


def test_bad_returns_and_raises_are_none_and_counted(hooks: str) -> None:
    scorer = _custom(hooks, "picky")
    rewards = scorer.score_sync(_samples("ok", "boom", "nan", "str", "none", "bool"))
    assert rewards == [2.0, None, None, None, None, 1.0]
    assert scorer.last_failure_count == 4
    assert "sample 1: raised ValueError: boom!" in scorer.last_failures[0]
    assert "non-finite" in scorer.last_failures[1]
    assert "not a number" in scorer.last_failures[2]
    assert "4 of 6" in scorer.failure_warning()
    # The counters describe the latest call only.
    assert scorer.score_sync(_samples("ok")) == [2.0]
    assert scorer.last_failure_count == 0 and scorer.failure_warning() is None

    failing = _custom(hooks, "async_boom")
    assert failing.score_sync(_samples("a", "b")) == [None, None]
    assert "RuntimeError: async boom" in failing.last_failures[0]


@pytest.mark.parametrize("fn", ["slow", "slow_async"])
def test_slow_function_times_out(hooks: str, fn: str) -> None:
    scorer = _custom(hooks, fn, "--rm-timeout", "0.2")
    release = load_function(f"{hooks}:slow").__globals__["RELEASE"]
    release.clear()
    try:
        assert scorer.score_sync(_samples("slow", "fast")) == [None, 1.0]
        assert scorer.last_failure_count == 1
        assert "timed out after 0.2 s" in scorer.last_failures[0]
    finally:
        release.set()  # let the abandoned thread finish
        scorer.close()


def test_group_functions(hooks: str) -> None:
    groups = [1, 0, 1, 0]
    scorer = _custom(hooks, "group_offsets", "--group-rm")
    assert scorer.score_sync(_samples("a", "bb", "ccc", "d", groups=groups)) == [
        11.0,
        2.0,
        13.0,
        1.0,
    ]

    # Group 1 raises: both its samples fail; group 0's second reward is inf.
    failing = _custom(hooks, "group_fails_odd", "--group-rm")
    assert failing.score_sync(_samples("a", "b", "c", "d", groups=groups)) == [
        None,
        1.0,
        None,
        None,
    ]
    assert failing.last_failure_count == 3
    assert any("group 1: raised RuntimeError: odd group" in m for m in failing.last_failures)

    short = _custom(hooks, "group_too_short", "--group-rm")
    assert short.score_sync(_samples("a", "b")) == [None, None]
    assert "returned 1 rewards for 2 samples" in short.last_failures[0]


def test_score_sync_inside_running_loop(hooks: str) -> None:
    scorer = _custom(hooks, "length")

    async def caller() -> list[float | None]:
        return scorer.score_sync(_samples("abc"))

    assert asyncio.run(caller()) == [3.0]


# ---------------------------------------------------------------- remote


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server = self.server
        with server.lock:
            server.hits[self.path] = hits = server.hits.get(self.path, 0) + 1
        if self.path == "/number":
            self._reply(200, len(body["response"]) + body["label"])
        elif self.path == "/object":
            self._reply(200, {"reward": body["metadata"]["w"]})
        elif self.path == "/trajectory":
            self._reply(200, len(body["trajectory"]))
        elif self.path == "/flaky":
            self._reply(500, "busy") if hits <= 2 else self._reply(200, 1.5)
        elif self.path == "/bad":
            self._reply(400, "missing field")
        elif self.path == "/hang":
            server.release.wait(30)
            self._reply(200, 1.0)

    def _reply(self, status: int, value: object) -> None:
        data = json.dumps(value).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.lock, httpd.hits, httpd.release = threading.Lock(), {}, threading.Event()
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.release.set()
    httpd.shutdown()
    httpd.server_close()


def _remote(url: str, *extra: str):
    return _scorer(parse_args(["--rm-url", url, *extra]))


def _url(server, path: str) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}{path}"


def test_remote_number_and_object_replies(server) -> None:
    samples = [RewardInput("p", "abc", 2, {"w": 0.25}, 0), RewardInput("p", "a", 10, {}, 0)]
    assert _remote(_url(server, "/number")).score_sync(samples) == [5.0, 11.0]
    assert _remote(_url(server, "/object")).score_sync(samples[:1]) == [0.25]
    # A multi-turn sample's whole trajectory goes along with its final answer.
    turns = RewardInput("p", "42", None, {}, 0, trajectory="call<eos>answer=42")
    assert _remote(_url(server, "/trajectory")).score_sync([turns]) == [18.0]


def test_remote_retries_5xx_until_success(server) -> None:
    scorer = _remote(_url(server, "/flaky"), "--rm-max-retries", "3")
    assert scorer.score_sync(_samples("x")) == [1.5]
    assert server.hits["/flaky"] == 3


def test_remote_4xx_fails_without_retry(server) -> None:
    scorer = _remote(_url(server, "/bad"), "--rm-max-retries", "3")
    assert scorer.score_sync(_samples("x")) == [None]
    assert server.hits["/bad"] == 1
    assert "HTTP 400" in scorer.last_failures[0] and "missing field" in scorer.last_failures[0]


def test_remote_timeout_and_refused_connection(server) -> None:
    hang = _remote(_url(server, "/hang"), "--rm-timeout", "0.2", "--rm-max-retries", "1")
    assert hang.score_sync(_samples("x")) == [None]
    assert server.hits["/hang"] == 2
    assert "gave up after 2 attempts" in hang.last_failures[0]

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    closed = _remote(f"http://127.0.0.1:{port}/", "--rm-max-retries", "0")
    assert closed.score_sync(_samples("x")) == [None]
    assert "gave up after 1 attempt" in closed.last_failures[0]


# ---------------------------------------------------------------- start-up checks


def test_bad_reward_flags_fail_at_start_up(hooks: str, tmp_path) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1", "label": "2"}\n')
    missing = tmp_path / "nowhere" / "rm.py"
    cases = [
        (["--custom-rm-path", "no_such_reward_module:fn"], "no_such_reward_module"),
        (["--custom-rm-path", f"{missing}:fn"], str(missing)),
        (["--custom-rm-path", f"{hooks}:nope"], "has no attribute 'nope'"),
        (["--custom-rm-path", f"{hooks}:one_param"], "cannot be called as fn\\(args, sample"),
        (["--prompt-data", str(data)], "pass --rm-type math\\|exact"),
        (["--prompt-data", str(data), "--rm-type", "builtin"], "builtin:<task>"),
        (["--rm-url", "http://x/", "--custom-rm-path", f"{hooks}:length"], "give only one"),
        (["--rm-url", "http://x/", "--rm-type", "math"], "give only one"),
        (["--group-rm", "--rm-type", "math"], "--group-rm needs --custom-rm-path"),
        (["--rm-url", "ftp://x/"], "expected http"),
        (["--rm-type", "math", "--rm-timeout", "0"], "--rm-timeout must be"),
    ]
    for argv, message in cases:
        with pytest.raises(ConfigError, match=message) as caught:
            parse_args(argv)
        assert "\n" not in str(caught.value)
    assert parse_args(["--prompt-data", str(data), "--rm-type", "math"]).rm_type == "math"


def test_math_without_math_verify_is_refused_at_start_up(tmp_path, monkeypatch) -> None:
    """--rm-type math is math-verify's verdict: without it installed the run does not
    start (no silent fall-back to other rules), and the one line says what to install."""
    import vime.rollout.rewards as rewards

    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1", "label": "2"}\n')
    monkeypatch.setattr(rewards, "math_verify_installed", lambda: False)
    with pytest.raises(ConfigError) as caught:
        parse_args(["--prompt-data", str(data), "--rm-type", "math"])
    message = str(caught.value)
    assert "math-verify" in message and "pip install -e '.[agents]'" in message
    assert "\n" not in message
    assert parse_args(["--prompt-data", str(data), "--rm-type", "exact"]).rm_type == "exact"


# ---------------------------------------------------------------- remote, under faults

FAULT_TIMEOUT_S = 0.5  # --rm-timeout of the run under faults
FAULT_STALL_S = 0.8  # a stalled request is answered this late: after the client gave up
FAULTS = ("drop", "error", "stall")  # each a ninth of the requests: a third fail


class _FaultyHandler(_Handler):
    """A reward service that fails a third of its requests: drops the connection halfway
    through the request, answers 500 or 503, or stalls past the timeout; else scores.

    It keys requests by their ``Idempotency-Key``: a key it has scored is answered
    from what it answered before (a replay), never scored again; ``answered`` counts
    each key's 200s, replays included.
    """

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        server = self.server
        key = self.headers["Idempotency-Key"]
        size = int(self.headers["Content-Length"])
        with server.lock:
            draw = server.rng.random()
            fault = FAULTS[int(draw * 9)] if draw < 1 / 3 else None
            server.log.setdefault(key, []).append(fault or "ok")
        if fault == "drop":
            self.rfile.read(size // 2)
            self.connection.shutdown(socket.SHUT_RDWR)  # the rest of the request unread
            self.close_connection = True
            return
        body = json.loads(self.rfile.read(size))
        if body["sample_id"] != key:
            server.log[key].append("another sample_id")
        if fault == "error":
            self._reply(500 if draw < 1 / 6 else 503, {"error": "busy"})
        elif fault == "stall":
            time.sleep(FAULT_STALL_S)
            with contextlib.suppress(OSError):  # the client has gone
                self._reply(503, {"error": "gave up"})  # what a proxy says to nobody
        else:
            with server.lock:
                if key not in server.scores:
                    server.scores[key] = round(server.rng.random(), 6)
                    server.content[key] = (body["prompt"], body["response"])
                server.answered[key] = server.answered.get(key, 0) + 1  # replays too
                score = server.scores[key]
            self._reply(200, {"reward": score})


class _Backlogged(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # http.server's 5 drops connections a loaded service takes


@pytest.fixture
def faulty_server():
    httpd = _Backlogged(("127.0.0.1", 0), _FaultyHandler)
    httpd.lock, httpd.rng = threading.Lock(), random.Random(34)
    httpd.log, httpd.scores, httpd.answered, httpd.content = {}, {}, {}, {}
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def test_remote_faults_under_load_score_each_sample_once(faulty_server, tmp_path) -> None:
    """1,000 samples through the rollout's own scoring (``RolloutManager.generate``) against
    a service failing a third of its requests: each sample is scored with the one score the
    service gave its key, or masked after exactly --rm-max-retries + 1 failed attempts, and
    the masked count is the metric's. Without one key per sample over its retries, the keys
    would outnumber the samples."""
    prompts, n, retries = 250, 4, 3
    tokenizer = build_tokenizer(CHARSET)
    script = [[f"r{i} {j}" for j in range(n)] for i in range(prompts)]
    (tmp_path / "adv.py").write_text(IDENTITY_ADVANTAGE)  # advantage = reward: readable
    flags = ["--rm-url", _url(faulty_server, "/score"), "--rm-timeout", str(FAULT_TIMEOUT_S)]
    flags += ["--rm-max-retries", str(retries), "--rollout-batch-size", str(prompts)]
    flags += ["--global-batch-size", str(prompts * n)]
    flags += ["--custom-advantage-function-path", f"{tmp_path / 'adv.py'}:advantages"]
    manager, _ = _setup(tmp_path, tokenizer, script, *flags)
    batch, metrics = manager.generate(0)
    manager.scorer.close()

    log, scores = faulty_server.log, faulty_server.scores
    assert len(log) == prompts * n  # one key per sample, the same on all its attempts
    # One 200 per scored sample: no retry once answered, so no replay was needed either.
    assert set(faulty_server.answered.values()) == {1}
    by_text = {text: key for key, text in faulty_server.content.items()}
    masked = 0
    for tokens, start, mask, advantage in zip(
        batch.tokens, batch.prompt_lengths, batch.loss_masks, batch.advantages, strict=True
    ):
        text = (tokenizer.decode(tokens[:start]), tokenizer.decode(tokens[start:-1]))
        key = by_text.get(text)
        if key is None:  # never answered 200: masked after every attempt failed
            masked += 1
            assert set(mask) == {0} and advantage == 0.0
            continue
        assert set(mask) == {1} and advantage == scores[key], text
        assert log[key][-1] == "ok" and "ok" not in log[key][:-1], log[key]
    unscored = [attempts for key, attempts in log.items() if key not in scores]
    assert len(unscored) == masked > 0
    assert all(len(a) == retries + 1 and "ok" not in a for a in unscored), unscored
    assert max(len(a) for a in log.values()) == retries + 1
    assert {f for a in log.values() for f in a} == {"ok", *FAULTS}
    assert metrics["rollout/reward_failures"] == masked
