"""The relevance gate (proxy/search/relevance.py): what it lets through, on made-up hits."""

from __future__ import annotations

import dataclasses
import itertools

from proxy.search.phrasing import anchors, content_words, is_question, is_request, only_asks
from proxy.search.relevance import (
    GateSettings,
    HitFeatures,
    admit,
    query_content,
    shares_word,
)

G = GateSettings()
_N = itertools.count()


def hit(
    cosine: float | None,
    *,
    score: float = 1.0,
    fts: int | None = 1,
    role: str = "user",
    content: str | None = None,
) -> HitFeatures:
    text = content if content is not None else f"My sister Marta lives in Porto since {next(_N)}"
    return HitFeatures(score, cosine, fts, 1, role, text)


def test_content_words_leave_out_greetings_thanks_and_stop_words() -> None:
    assert content_words("Thanks, that's all! ok bye") == []
    assert content_words("Hi there, good morning :)") == []
    assert content_words("My sister Marta lives in Porto") == ["sister", "marta", "lives", "porto"]
    assert content_words("code 4711") == ["code", "4711"]


def test_questions_are_told_from_statements() -> None:
    assert is_question("when did I go to Kyoto")
    assert is_question("Remind me of my garage code")
    assert is_question("and the code was…?")
    assert not is_question("I'm planning my week.")
    assert not is_question("Make it shorter")
    assert query_content("thanks!").words == 0


def test_a_message_without_content_words_gets_nothing_but_a_question_a_very_close_hit() -> None:
    q = query_content("thanks, that's all")
    assert admit(q, [hit(0.45), hit(0.3)], G) == []
    assert admit(q, [hit(0.9)], G) == []  # a statement: nothing to share a word with
    q = query_content("and what was it again?")
    assert q.words == 0 and q.question
    assert admit(q, [hit(0.45), hit(0.3)], G) == []
    assert admit(q, [hit(0.9)], G) == [0]  # cosine_alone


def test_a_statement_takes_only_what_both_paths_found() -> None:
    """A chat's short turns are embedded as "user: …", and that shared start lifts their
    cosine: the chat bench's "For Wednesday, suggest a dinner I can make in twenty minutes."
    drew "I usually cook it on Thursday evenings." (no word shared, cosine 0.56)."""
    q = query_content("On Wednesday I want a dinner I can make in twenty minutes.")
    assert not q.question and q.anchors is None  # a statement, not a task
    cook = "I usually cook it on Thursday evenings."
    assert admit(q, [hit(0.56, fts=None, content=cook)], G) == []
    assert admit(q, [hit(0.9, fts=None, content=cook)], G) == []
    # Full-text search also finds a turn by its neighbours' words: its rank is not enough.
    assert admit(q, [hit(0.56, fts=3, content=cook)], G) == []
    dinners = "Our dinners on Wednesdays are always vegetarian."
    assert admit(q, [hit(0.56, content=dinners)], G) == [0]  # its own word, and close
    assert admit(q, [hit(0.45, content=dinners)], G) == []  # a shared word alone: no
    q = query_content("Which day did I say I cook?")  # a question: the vector alone may do
    assert admit(q, [hit(0.56, fts=None, content=cook)], G) == [0]


def test_a_task_draws_on_memory_only_through_what_it_names() -> None:
    """The chat bench's planning tasks drew memories by a common word: "Can you summarise the
    plan for Monday to Wednesday?" got "I usually cook it on Monday evenings.", "How long
    before the guests arrive should I start cooking?" got "I usually cook it on Wednesday
    evenings." (cosines 0.51 and 0.59)."""
    cook = "I usually cook it on Monday evenings."
    for text in (
        "Can you summarise the plan for Monday to Wednesday?",
        "How long before the guests arrive should I start cooking?",
        "For Wednesday, suggest a dinner I can cook in twenty minutes.",
    ):
        q = query_content(text)
        assert q.anchors == frozenset() and not q.question, text
        assert admit(q, [hit(0.7, content=cook)], G) == [], text
    # what a task names ties it to a memory: a name, or what follows "my" / "our"
    hugo = "My best friend Hugo has his birthday on 24 September."
    q = query_content("Can you suggest a present for Hugo?")
    assert q.anchors == frozenset(["hugo"]) and admit(q, [hit(0.6, content=hugo)], G) == [0]
    vera = "Guess what, my sister Vera got a job in Utrecht!"
    q = query_content("Write a short birthday message for my sister.")
    assert q.anchors == frozenset(["sister"]) and admit(q, [hit(0.6, content=vera)], G) == [0]
    assert anchors("On Friday, tell Lukas about it. Then my week starts.") == frozenset(["lukas"])
    # a statement is no task: its shared word is enough
    q = query_content("I might cook something on Monday.")
    assert q.anchors is None and admit(q, [hit(0.7, content=cook)], G) == [0]


def test_a_models_boilerplate_is_never_a_memory() -> None:
    """The chat bench's small model answered "When is the deadline…" turns with "I'm sorry for
    any confusion, but as a personal assistant…": the user's own words stay, the reply goes."""
    q = query_content("When is the deadline for project Orchard?")
    mine = "At work I'm now leading project Orchard, the rewrite of the warehouse app."
    for reply in (
        "I'm sorry for any confusion, but as a personal assistant, I help with projects.",
        "As an AI language model, I can't know the deadline of project Orchard.",
        "I apologize for the misunderstanding. Project Orchard is due soon.",
    ):
        hits = [hit(0.7, content=mine), hit(0.7, role="assistant", content=reply)]
        assert admit(q, hits, G) == [0], reply
    # the same words later in a reply, or said by a person, are not boilerplate
    later = "Project Orchard is due in April. As an assistant I keep track of it."
    assert admit(q, [hit(0.7, role="assistant", content=later)], G) == [0]
    person = "As a personal assistant to the CEO, I run project Orchard's schedule."
    assert admit(q, [hit(0.7, content=person)], G) == [0]


def test_a_questions_hit_that_shares_only_a_vague_word_needs_a_close_meaning() -> None:
    """The chat bench's "What's the name of our new pet again?" drew "Hi, I'm moving to a new
    flat…" (full-text search on "new", cosine 0.23) beside the cat."""
    q = query_content("What's the name of our new pet again?")
    cat = hit(0.6, content="We adopted a cat last week! We called it Ziggy.")  # no word shared
    flat = "Hi, I'm moving to a new flat at the end of the month."
    assert admit(q, [cat, hit(0.23, content=flat)], G) == [0]
    assert admit(q, [cat, hit(0.55, content=flat)], G) == [0, 1]  # as close as a vector's hit
    new_pet = "The new pet sleeps all day."  # "pet" is a word of its own
    assert admit(q, [cat, hit(0.23, content=new_pet)], G) == [0, 1]


def test_a_shared_word_is_the_same_word_or_one_starting_the_other() -> None:
    terms = query_content("I'm cooking on Thursdays").terms
    assert shares_word(terms, ["cook", "pasta"]) and shares_word(terms, ["thursday"])
    assert not shares_word(terms, ["coo", "thu"]) and not shares_word(terms, ["monday"])
    assert not shares_word(frozenset(), ["cook"])


def test_bare_acknowledgements_are_never_memories() -> None:
    q = query_content("What did you say about that?")
    hits = [hit(0.9, content="ok"), hit(0.9, content="Thanks!"), hit(0.9, content="haha nice")]
    assert admit(q, hits, G) == []


def test_a_statement_and_a_memory_sharing_only_a_light_word_are_not_related() -> None:
    """The chat bench's "Saturday we'd like a hike…" drew "Monday I need to do groceries and
    I'd like a gym session…" (shared: "like")."""
    q = query_content("Saturday we'd like a hike in the morning and a museum after lunch.")
    gym = "Monday I need to do groceries and I'd like a gym session in the evening."
    assert admit(q, [hit(0.6, content=gym)], G) == []
    museum = "The museum is closed on Mondays, we'd like to go another day."
    assert admit(q, [hit(0.6, content=museum)], G) == [0]  # "museum" ties them
    assert shares_word(frozenset(["cook", "like"]), ["cooking"])  # stems still count
    assert not shares_word(frozenset(["new", "flat"]), ["new", "pet"])


def test_a_statement_takes_only_the_closest_hit_near_the_best() -> None:
    """Not a question: one memory at most (the chat bench's statements drew loosely related
    turns: "Okay, let's keep going." the user's "let's keep it simple"), close to it."""
    q = query_content("I'm planning a trip to Porto next week.")
    hits = [
        hit(0.45, score=1.0),  # not close enough to a statement
        hit(0.6, score=0.5),  # far below the best score
        hit(0.55, score=0.85),
        hit(0.7, score=0.82),  # a second one
    ]
    assert admit(q, hits, G) == [2]
    assert admit(q, hits, dataclasses.replace(G, statement_top=3)) == [2, 3]


def test_a_question_takes_every_hit_over_its_cosine_near_the_best_score_whatever_its_rank() -> None:
    q = query_content("Where does my sister live?")
    hits = [
        hit(0.6, score=1.0),
        hit(0.25, score=0.8),
        hit(G.question_cosine - 0.03, score=0.9),  # not close enough
        hit(0.45, score=0.7),  # far below the best score
        hit(G.cosine_alone, score=0.5),  # but one this close goes whatever its score
    ]
    assert admit(q, hits, G) == [0, 1, 4]


def test_a_models_reply_needs_more_than_a_users_words() -> None:
    q = query_content("Where did I travel last spring?")
    bar = G.question_cosine + G.assistant_extra / 2
    hits = [hit(0.7), hit(bar, role="user"), hit(bar, role="assistant")]
    assert admit(q, hits, G) == [0, 1]


def test_a_vector_only_hit_needs_the_higher_bar_and_no_cosine_passes_on_full_text() -> None:
    q = query_content("Where does my sister live?")
    assert admit(q, [hit(0.4, fts=None)], G) == []
    assert admit(q, [hit(0.55, fts=None)], G) == [0]
    assert admit(q, [hit(None)], G) == [0]  # fts-only (no vector path): rank alone
    assert admit(q, [hit(None, fts=None)], G) == []


def test_the_gate_off_passes_everything_in_order() -> None:
    off = GateSettings(enabled=False)
    hits = [hit(-1.0, content="ok"), hit(0.0)]
    assert admit(query_content("thanks"), hits, off) == [0, 1]
    assert admit(query_content("thanks"), [], G) == []


def test_nothing_goes_unless_some_hit_is_close_to_the_message() -> None:
    q = query_content("What can I prepare the day before?")
    weak = [hit(G.best_cosine - 0.01), hit(0.3), hit(0.25)]
    assert admit(q, weak, G) == []
    q = query_content("Where does my sister live?")
    assert admit(q, [hit(G.best_cosine), hit(0.3), hit(0.25)], G) == [0, 1, 2]


def test_a_request_to_the_assistant_is_not_a_question_about_what_was_said() -> None:
    for text in (
        "Hi! Can you help me plan my week?",
        "What should I pack for two nights?",
        "Make that a bit shorter please.",
        "Any tips for the first month at home?",
        "ok, let's keep going",
        "How long before the guests arrive should I start cooking?",  # advice, not a memory
        "Hello! I'm planning a weekend away with two friends, can you help?",  # a closing ask
        "We land at nine, any ideas for the first evening?",
        "For Wednesday, suggest a dinner I can make in twenty minutes.",  # a short lead first
        "Tonight, can you keep it short?",
    ):
        assert is_request(text), text
        assert not query_content(text).question, text
    for text in (
        "When did Caroline go to the support group?",
        "Remind me of my garage code",
        "What did I say I should bring?",
        "I went to Graz last spring, can you believe it?",
        "Yesterday we went, can you believe it?",  # a lead with a pronoun tells something
        "Could you remind me what I said about the trip?",  # asks what was said
    ):
        assert not is_request(text), text
        assert query_content(text).question, text
    # a statement with a request is a statement; a statement with a question is a question
    assert not query_content("I'm moving next month. Can you help me organise it?").question
    assert query_content("I'm moving next month. Where did I put the van's number?").question
    # a greeting is neither: the question is what the message asks
    assert query_content("Thanks! And what was it again?").question
    assert not query_content("Hi there! Can you help me plan my week?").question


def test_a_turn_that_only_asks_or_asks_for_something_is_never_a_memory() -> None:
    assert only_asks("Which dish did I say was my favourite?")
    assert only_asks("For Wednesday, suggest a dinner I can make in twenty minutes.")
    assert not only_asks("Yesterday, I made a cake.")
    assert only_asks("Please keep the answers short. Can you list them?")
    assert not only_asks("My favourite dish is bibimbap. Do you know it?")
    assert only_asks("Hi! Can you help me plan my week?")  # a greeting says nothing either
    assert only_asks("Hello! Thanks so much. Any tips for packing?")
    assert not only_asks("Hi! I just got back from Graz. Can you help me unpack?")
    assert not only_asks("Why? " * 1000)  # a long turn is not split sentence by sentence
    assert not is_request("I " + "ok " * 20_000)  # only its opening words are read
    q = query_content("What is my favourite dish?")
    hits = [
        hit(0.8, content="Which dish did I say was my favourite?"),
        hit(0.7, content="My favourite dish is bibimbap, I could eat it every day."),
    ]
    assert admit(q, hits, G) == [1]


def test_a_hit_saying_nothing_another_does_not_goes_and_the_users_words_stay() -> None:
    q = query_content("What was the garage door code again?")
    hits = [
        hit(0.8, role="assistant", content="The new garage door code is 8042."),
        hit(0.75, content="Note for later: the new garage door code is 8042."),
        hit(0.6, content="Note for later: the new garage door code is 8042."),  # sent twice
        hit(0.5, content="The old garage door opener broke after the power cut."),
    ]
    assert admit(q, hits, G) == [1, 3]


def test_a_models_reply_the_users_kept_turns_say_between_them_goes() -> None:
    q = query_content("What day and time was the dentist appointment?")
    hits = [
        hit(0.8, role="assistant", content="The appointment was on Tuesday at 9:45."),
        hit(0.7, content="I booked a dentist appointment with Dr. Novak."),
        hit(0.65, content="It's on Tuesday at 9:45, I must not forget it."),
        hit(0.6, role="assistant", content="Dr. Novak's practice moved to Elm Street in May."),
    ]
    # the first reply says nothing the two user turns do not; the last one does
    assert admit(q, hits, G) == [1, 2, 3]
    # a person's words (a user turn) are never dropped for being said by others together
    person = [dataclasses.replace(hits[0], role="user"), *hits[1:]]
    assert admit(q, person, G) == [0, 1, 2, 3]


def test_a_models_reply_that_mostly_repeats_a_kept_hit_goes() -> None:
    q = query_content("When is the deadline for project Orchard?")
    sorry = "Orchard is an opportunity to showcase the potential of a business, built"
    hits = [
        hit(0.8, content="At work I'm now leading project Orchard, the warehouse app."),
        hit(0.75, role="assistant", content=sorry + " of every kind."),
        hit(0.7, content="The deadline is the 16th of April, which is tight."),
        hit(0.65, role="assistant", content=sorry + " of any size, truly."),
        hit(0.6, role="assistant", content="Orchard's review with the client is in early April."),
    ]
    # the second reply has 6 of its 8 words in the first: it goes; the last reply shares
    # "Orchard" and "April" with the kept hits, 2 of its 5 words, and stays
    assert admit(q, hits, G) == [0, 1, 2, 4]
    # a person's words stay whatever they repeat
    person = [*hits[:3], dataclasses.replace(hits[3], role="user"), hits[4]]
    assert admit(q, person, G) == [0, 1, 2, 3, 4]


def test_a_question_about_the_users_own_words_takes_a_models_reply_only_when_very_close() -> None:
    """ "Which dish did I say was my favourite?" drew three of the small model's babbling replies
    that named the dish beside the user's own words (bench.prefix); a question about two other
    people (LoCoMo's) still takes a reply as it takes a user's words."""
    hits = [
        hit(0.6, content="My favourite dish is bibimbap, I could eat it every day."),
        hit(0.45, role="assistant", content="Bibimbap, a Korean fusion dish, ahem. Not sure."),
        hit(0.55, role="assistant", content="Bibimbap with a side salad is a classic Korean meal."),
    ]
    own = query_content("Which dish did I say was my favourite?")
    assert own.question and own.own
    assert admit(own, hits, G) == [0, 2]
    other = query_content("Which dish did Caroline say was her favourite?")
    assert other.question and not other.own
    assert admit(other, hits, G) == [0, 1, 2]


def test_a_hit_no_closer_than_an_empty_turn_of_its_speaker_goes() -> None:
    """Cosines owed to the shared "user: " start alone: "Okay, let's keep going." is at 0.62
    from "…so let's keep it simple." and from an empty "user: " turn alike."""
    q = query_content("Where does my sister live?")
    lifted = dataclasses.replace(hit(0.62), baseline=0.62 - G.min_lift + 0.01)
    assert admit(q, [dataclasses.replace(hit(0.62), baseline=0.62)], G) == []
    assert admit(q, [lifted], G) == []
    assert admit(q, [dataclasses.replace(hit(0.62), baseline=0.3)], G) == [0]
    assert admit(q, [hit(0.62)], G) == [0]  # no baseline known: the other bars alone


def test_a_long_turn_goes_whatever_the_empty_turn_of_its_speaker() -> None:
    """On a long turn its words make the cosine, not the shared "user: " start: a full-text
    rank 1 answer ("…since I moved from my home country…" for "Where did Caroline move from 4
    years ago?") is 0.013 below the empty turn and still goes; one word fewer than
    ``lift_words`` and it does not."""
    q = query_content("Where did Caroline move from 4 years ago?")
    # three content words ("moved", "home", "country") and made-up ones up to the bar
    short = "Moved from my home country, " + " ".join(f"w{i}x" for i in range(G.lift_words - 4))
    long = short + " Sweden"
    assert len(content_words(short)) == G.lift_words - 1
    assert len(content_words(long)) == G.lift_words
    close = hit(0.5, content="Caroline grew up abroad, in a small town by the sea.")

    def kept(content: str, baseline: float) -> list[int]:
        candidate = dataclasses.replace(hit(0.189, content=content), baseline=baseline)
        return admit(q, [close, candidate], G)

    assert kept(long, 0.202) == [0, 1]
    assert kept(short, 0.202) == [0]
    assert kept(short, 0.1) == [0, 1]
