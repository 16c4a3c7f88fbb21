"""More training prompts for the EAGLE head: task templates crossed with subjects, texts and numbers.

The hand-written ``train_prompts.txt`` has about two hundred prompts; a draft head learns the
target's habits (how it opens an answer, lists, code, explanations, small talk) from the target's
own answers, and more varied prompts give it more of them. ``mixed_prompts(n, seed)`` draws ``n``
distinct prompts from the families below (all written for this project), in fixed shares so that
a small ``n`` is as varied as a large one::

    family        built from                                              share
    topics        task templates x subjects ("Explain {s} ...")           0.24
    constrained   questions x constraints ("... Answer in three sentences.") 0.10
    texts         rewrite / summarise / reply tasks x short texts           0.08
    maths         word problems with seeded numbers                       0.09
    code          functions in twelve languages, snippets to explain,      0.16
                  SQL, programming concepts
    chat          small talk, hobbies, moods, personal situations           0.08
    how-to        how-to questions x phrasings                              0.07
    compare       pairs people confuse x phrasings                          0.04
    writing       emails and messages, stories and poems                    0.08
    words         words, idioms, trips, names                               0.06

A family with too few prompts leaves its share to the others. The prompts of
``train_prompts.txt`` (its first lines are the held-out set) are never produced, and neither is
anything on the held-out prompts' topics (see ``_AVOID``).
"""

from __future__ import annotations

import itertools
import os
import random
from collections.abc import Callable

__all__ = ["mixed_prompts", "prompt_families"]


def _lines(block: str) -> list[str]:
    return [ln.strip() for ln in block.strip().splitlines() if ln.strip()]


def _items(block: str) -> list[str]:
    return [" ".join(x.split()) for x in block.split(",") if x.strip()]


def _texts(block: str) -> list[str]:
    return [" ".join(p.split()) for p in block.strip().split("\n\n")]


# Topics of the held-out prompts: no mixed prompt mentions them (lower case substrings).
_AVOID = (
    "fibonacci", "water cycle", "photosynthesis", "sleep", "bicycle", "tuple", "tomato soup",
    "working from home", "work from home", "bakery", "sky look", "sky is blue", "autumn leaves",
    "good morning",
)  # fmt: skip

# ---------------------------------------------------------------------------------- topics
SUBJECTS = _items("""
    the moon, coffee, volcanoes, the internet, honeybees, rainforests, electric cars, the Roman Empire,
    chess, black holes, the human heart, origami, jazz music, recycling, ocean tides, bread making,
    solar panels, the printing press, penguins, mountain climbing, public libraries, vaccines, the
    French language, clouds, the stock market, ancient Egypt, gardening, earthquakes, friendship,
    robots, tea, the Olympic Games, dinosaurs, the piano, airplanes, deserts, time management,
    meditation, the periodic table, snowflakes, coral reefs, video games, trains, cheese making, the
    Great Wall of China, lighthouses, kites, rivers, the immune system, money, maps, volunteering, owls,
    glass making, the violin, thunderstorms, spices, public speaking, castles, bridges, comets, museums,
    cats, dogs, whales, pizza, the alphabet, birthdays, umbrellas, football, climate change,
    typewriters, satellites, mushrooms, the human brain, DNA, electricity, magnets, rainbows, the Amazon
    River, the Arctic, glaciers, wind turbines, nuclear power, batteries, smartphones, social media,
    artificial intelligence, cryptography, the telephone, photography, cinema, theatre, opera, ballet,
    hip-hop, the guitar, painting, sculpture, poetry, newspapers, podcasts, board games, jigsaw puzzles,
    magic tricks, zoos, farms, beekeeping, composting, houseplants, wolves, elephants, octopuses, ants,
    butterflies, sharks, dolphins, horses, parrots, frogs, the Silk Road, the Vikings, the Renaissance,
    the Industrial Revolution, the first Moon landing, ancient Greece, the Maya civilization, pirates,
    knights and castles, the Eiffel Tower, the pyramids of Giza, cloud computing, open-source software,
    skateboarding, swimming, yoga, tennis, basketball, marathons, vegetarian cooking, chocolate, ice
    cream, sushi, rice, honey, salt, fire, the wheel, paper, clocks, calendars, sign language, dreams,
    kindness, habits, procrastination, budgeting, job interviews, leadership, teamwork, first aid,
    hurricanes, the solar system, Mars, Jupiter, the Sun, telescopes, microscopes, bacteria, trees,
    seeds, soil, bees and flowers, the ocean floor, fossils, sound, light, gravity, the weather
""")

TOPIC_TASKS = _lines("""
    Explain {s} to a beginner.
    Write a short story about {s}.
    List five facts about {s}.
    What are the pros and cons of {s}?
    Write a short poem about {s}.
    Give me three practical tips related to {s}.
    Summarize the history of {s} in one paragraph.
    Describe {s} in simple words for a child.
    What are common misconceptions about {s}?
    Write a friendly email to a colleague about {s}.
    Create a quiz with three questions about {s}, with answers.
    What makes {s} important?
    Write a dialogue between two friends talking about {s}.
    What would the world look like without {s}?
    Write a limerick about {s}.
    What questions should I ask an expert on {s}?
    Write a short speech to introduce {s} to an audience.
    Give me an outline for an essay about {s}.
    Explain {s} using an analogy.
    How has {s} changed in the last hundred years?
    Write a JSON object describing {s} with a name, a category and three tags.
    Tell me a fun fact about {s} and explain why it is true.
    Write a review of a book about {s}.
    I have to give a five-minute talk about {s} at school tomorrow. Can you help me plan what to say?
    My friend finds {s} boring. Give me three arguments that might change her mind.
    I'm writing a children's book. Write the opening paragraph of a story about {s}.
    Explain {s} in exactly three sentences.
    Describe {s} in under fifty words.
    Write two short paragraphs about {s}: one for a child and one for an expert.
    What are the three most important things to know about {s}? Use a numbered list.
    Write a short social media post about {s}.
    Give me five questions to test my knowledge of {s}. Don't include the answers.
    Write a short news report about a surprising discovery related to {s}.
    Explain {s} as if you were a pirate.
    What jobs are connected to {s}?
    Write a riddle about {s} and give the answer at the end.
    What would a museum exhibition about {s} show? Describe three rooms.
    I know nothing about {s}. Where should I start?
    Tell me something about {s} that most people don't know.
    Write a short diary entry by someone who loves {s}.
    Give me a one-sentence definition of {s}, then a longer explanation.
    Write a short paragraph arguing that schools should teach more about {s}.
    Make a table with three columns about {s}: fact, explanation, and why it matters.
    What might a curious ten-year-old ask about {s}? Answer two of those questions.
    Tell me a short joke about {s}.
    Write a haiku about {s}.
""")

# ---------------------------------------------------------------------------------- constrained
QUESTIONS = _lines("""
    Tell me about {s}.
    Why do people care about {s}?
    How does {s} affect everyday life?
    What is the future of {s}?
    Teach me the basics of {s}.
    Write a short introduction to {s}.
    What should a beginner know about {s}?
    What is the most interesting thing about {s}?
""")

CONSTRAINTS = _lines("""
    Answer in three sentences.
    Keep it under 100 words.
    Use a bulleted list.
    Use simple words that a child would understand.
    Write it as a numbered list of five points.
    Start with a surprising fact.
    End with a question for me.
    Answer in one short paragraph.
    Use a friendly, casual tone.
    Write it in a formal tone.
    Include one example from everyday life.
    Avoid technical terms.
""")

# ---------------------------------------------------------------------------------- texts
TEXTS = _texts("""
    Our town library will close for renovation from March 3 to April 15. During this time, books
    can be returned at the community centre on Elm Street. The library's website will continue to
    offer e-books and audiobooks.

    I bought these headphones two months ago. The sound is clear and the battery lasts almost a
    full day, but the ear cushions started to peel after a few weeks. For the price, I expected
    better quality.

    Hi team, the quarterly meeting has been moved from Thursday to Friday at 10 a.m. Please bring
    your project updates and be ready to share one challenge you faced. Lunch will be provided.

    Sea otters wrap themselves in kelp so that they do not drift away while they rest. They also
    use rocks as tools to crack open shellfish. Their thick fur keeps them warm in cold water.

    The city council voted on Tuesday to plant two thousand trees along the main roads over the
    next three years. Supporters say the trees will cool the streets in summer and reduce noise.
    Some residents worry about the cost of looking after them.

    Yesterday I finally climbed the hill behind my grandmother's house. The path was steeper than I
    remembered, and I had to stop twice to catch my breath. At the top, the whole valley was
    covered in fog, and it felt like standing above the clouds.

    To reset your password, click the link in this email and enter a new password of at least
    eight characters. The link expires in 24 hours. If you did not ask for a reset, you can ignore
    this message.

    Mix two cups of flour with a teaspoon of baking powder and a pinch of salt. Add one egg, a cup
    of milk and two spoons of melted butter, then stir until smooth. Cook small portions in a hot
    pan until golden on both sides.

    The museum's new dinosaur hall opens this weekend. Visitors can see a full skeleton of a
    Triceratops and touch copies of real fossils. Tickets are free for children under twelve.

    Dear Ms. Patel, thank you for your application for the assistant position. We were impressed by
    your experience and would like to invite you to an interview next Wednesday at 2 p.m. Please
    confirm whether this time works for you.

    Honeybees tell each other where to find flowers with a movement called the waggle dance. The
    angle of the dance shows the direction, and its length shows the distance. Other bees watch
    and then fly straight to the food.

    Our startup builds small sensors that measure how wet the soil is. Farmers place them in their
    fields and get an alert on their phones when the crops need water. In a pilot project, farms
    used thirty percent less water.

    I can't believe the train was late again this morning. I waited forty minutes on the platform
    in the rain, and there was no announcement at all. This is the third time this week.

    The Great Barrier Reef is the largest coral reef system in the world. It stretches over 2,300
    kilometres along the coast of Australia and is home to thousands of species. Warmer seas have
    caused serious coral bleaching in recent years.

    Please remember that the office kitchen will be cleaned on Friday afternoon. Anything left in
    the fridge after 3 p.m. will be thrown away. Label your food if you want to keep it.

    Maria started learning the guitar at the age of forty. At first her fingers hurt and the chords
    sounded terrible, but she practised for fifteen minutes every evening. A year later she played
    a song at her daughter's wedding.

    The new phone has a larger screen, a faster processor and a camera that works well in low
    light. However, it no longer has a headphone jack, and the charger is sold separately. It will
    be available in three colours from next month.

    Water boils at 100 degrees Celsius at sea level, but at a lower temperature high in the
    mountains. This is because the air pressure is lower there. As a result, cooking pasta takes
    longer on a mountain.

    The school is looking for volunteers to help with the spring fair on May 20. Tasks include
    setting up stalls, selling tickets and cleaning up afterwards. If you can help for an hour or
    two, please sign up at the front desk.

    After three days of heavy rain, the river rose above its banks and flooded several streets in
    the old town. Nobody was hurt, but many shops had to close. The water is expected to go down by
    the end of the week.

    Thank you so much for the lovely birthday present! The scarf is beautiful and exactly my
    favourite colour. I wore it to work today and got three compliments.

    Earth observation satellites take pictures of the planet in many wavelengths of light.
    Scientists use these images to track forest fires, measure ice sheets and predict harvests.
    Some satellites pass over the same spot every few days.

    The restaurant was cosy and the staff were friendly. The first course was a bit salty, but the
    main course was excellent and the dessert was the best I have had in years. We will definitely
    come back.

    Starting next month, the gym will open at 5 a.m. on weekdays. Members can also book group
    classes through the new app. Monthly fees will stay the same.

    Octopuses have three hearts and blue blood. Each of their eight arms can taste and touch, and
    they can change colour in less than a second. Some have been seen carrying coconut shells to
    use as shelters.

    i think we should move the deadline to next friday because the design team still need more
    time and the client hasnt sent the final text yet, let me know what u think

    The ancient city of Petra was carved into pink sandstone cliffs in what is now Jordan. It was
    an important trading centre more than two thousand years ago. Today it is one of the most
    visited archaeological sites in the world.

    Our neighbourhood cleanup collected forty bags of rubbish from the park and the riverbank last
    Saturday. Thirty people joined, including many children. The next cleanup is planned for the
    first Saturday of June.

    Learning a new language as an adult is hard, but not impossible. Short daily practice works
    better than long sessions once a week. Speaking with native speakers, even badly at first,
    speeds up progress.

    The package was supposed to arrive on Monday, but the tracking page has said "in transit" for
    six days. I have emailed customer service twice and received no reply. I would like a refund or
    a clear delivery date.

    Lightning is a giant spark of electricity between clouds, or between a cloud and the ground. It
    heats the air to about 30,000 degrees Celsius, which makes the air expand so fast that we hear
    thunder.

    Welcome to the team, Jonas! You will be working with the data group on the new reporting tool.
    Your laptop is ready at the IT desk, and your first meeting with your mentor is on Monday at 9.
""")

TEXT_TASKS = [
    "Summarize this text in one sentence:\n\n{t}",
    "Rewrite the following text in a more formal tone:\n\n{t}",
    "Rewrite this text so that a seven-year-old can understand it:\n\n{t}",
    "What is the main point of this text?\n\n{t}",
    "Suggest a short title for this text:\n\n{t}",
    "List the key facts from this text as bullet points:\n\n{t}",
    "Correct any spelling, grammar or punctuation mistakes in this text and give me the corrected version:\n\n{t}",
    "Translate this text into Spanish:\n\n{t}",
    "Write three questions that a reader might ask after reading this text:\n\n{t}",
    "Continue this text with two or three more sentences:\n\n{t}",
    "Is the tone of this text positive, negative or neutral? Explain briefly.\n\n{t}",
    "Make this text shorter without losing any important information:\n\n{t}",
    "Write a short, polite reply to this message:\n\n{t}",
    "Here is a short text:\n\n{t}\n\nRewrite it as a short poem.",
    "Read the text below and tell me who it is written for, and why.\n\n{t}",
    "Turn this text into three questions with their answers:\n\n{t}",
]  # fmt: skip


# ---------------------------------------------------------------------------------- maths
def _change(r: random.Random) -> dict[str, int]:
    a, b = r.randint(2, 9), r.randint(2, 15)
    return {"a": a, "b": b, "c": next(c for c in (10, 20, 50, 100, 200) if c > a * b)}


def _heads_legs(r: random.Random) -> dict[str, int]:
    chickens, cows = r.randint(3, 40), r.randint(2, 30)
    return {"a": chickens + cows, "b": 2 * chickens + 4 * cows}


def _nums(**ranges: tuple[int, int]) -> Callable[[random.Random], dict[str, int]]:
    return lambda r: {k: r.randint(lo, hi) for k, (lo, hi) in ranges.items()}


MATHS: list[tuple[str, Callable[[random.Random], dict[str, int]]]] = [
    ("A baker makes {a} loaves of bread every morning. How many loaves does she make in {b} days?",
     _nums(a=(12, 90), b=(3, 30))),
    ("Tom has {a} marbles. He gives {b} to his sister and then buys {c} more. How many marbles does he have now?",
     _nums(a=(20, 80), b=(2, 19), c=(3, 25))),
    ("A train travels at {a} kilometres per hour. How far does it go in {b} hours?", _nums(a=(60, 300), b=(2, 9))),
    ("A shirt costs {a} dollars and is on sale for {b}% off. What is the sale price?",
     _nums(a=(15, 120), b=(10, 60))),
    ("If {a} workers can paint a fence in {b} hours, how long would it take {c} workers working at the same speed?",
     _nums(a=(2, 6), b=(4, 24), c=(3, 12))),
    ("A rectangle is {a} cm long and {b} cm wide. What are its area and its perimeter?", _nums(a=(5, 60), b=(2, 40))),
    ("Sara reads {a} pages a day. Her book has {b} pages. How many days will it take her to finish it?",
     _nums(a=(8, 45), b=(120, 640))),
    ("A class has {a} students, and {b} of them are girls. What percentage of the class are boys?",
     _nums(a=(20, 36), b=(5, 19))),
    ("What is {a} multiplied by {b}? Show your working.", _nums(a=(12, 999), b=(11, 99))),
    ("What is {a} divided by {b}? Give the answer with two decimal places.", _nums(a=(100, 9999), b=(3, 97))),
    ("A recipe needs {a} grams of sugar for {b} cookies. How much sugar do I need for {c} cookies?",
     _nums(a=(100, 400), b=(12, 24), c=(30, 90))),
    ("I saved {a} dollars a week for {b} weeks and then spent {c} dollars on a new phone. How much do I have left?",
     _nums(a=(15, 60), b=(10, 30), c=(100, 300))),
    ("A car uses {a} litres of fuel per 100 kilometres. How much fuel does it need for a trip of {b} kilometres?",
     _nums(a=(4, 12), b=(150, 1200))),
    ("The temperature was {a} degrees Celsius in the afternoon and dropped by {b} degrees by midnight. What was "
     "the temperature at midnight?", _nums(a=(-5, 25), b=(3, 20))),
    ("A square garden has sides of {a} metres. How much fencing is needed to go all the way around it?",
     _nums(a=(4, 60))),
    ("Anna is {a} years old. Her father is {b} times as old as she is. How old will her father be in {c} years?",
     _nums(a=(6, 14), b=(3, 5), c=(2, 20))),
    ("A shop sells pencils in packs of {a}. How many packs do I need to buy to get at least {b} pencils?",
     _nums(a=(6, 24), b=(50, 400))),
    ("A water tank holds {a} litres and is filled at {b} litres per minute. How long does it take to fill it from "
     "empty?", _nums(a=(200, 5000), b=(8, 60))),
    ("Solve for x: {a}x + {b} = {c}.", _nums(a=(2, 12), b=(1, 50), c=(51, 200))),
    ("What is the average of {a}, {b} and {c}?", _nums(a=(1, 100), b=(1, 100), c=(1, 100))),
    ("Convert {a} kilometres to miles.", _nums(a=(2, 500))),
    ("Convert {a} degrees Fahrenheit to Celsius.", _nums(a=(-10, 110))),
    ("Is {a} a prime number? Explain how you checked.", _nums(a=(50, 997))),
    ("What is {a}% of {b}?", _nums(a=(3, 95), b=(40, 2000))),
    ("A pizza is cut into {a} equal slices. If {b} friends share it equally, how many slices does each get, and how "
     "many are left over?", _nums(a=(8, 16), b=(3, 7))),
    ("A film starts at 7:{a} p.m. and lasts {b} minutes. At what time does it end?", _nums(a=(10, 55), b=(85, 170))),
    ("What is the sum of all whole numbers from 1 to {a}?", _nums(a=(10, 500))),
    ("A farmer has chickens and cows. Together they have {a} heads and {b} legs. How many chickens and how many "
     "cows are there?", _heads_legs),
    ("Lisa bought {a} notebooks at {b} dollars each and paid with a {c}-dollar note. How much change did she get?",
     _change),
    ("A cyclist rides {a} km in {b} minutes. What is her average speed in kilometres per hour?",
     _nums(a=(5, 60), b=(20, 180))),
    ("There are {a} red balls and {b} blue balls in a bag. If I pick one at random, what is the probability that it "
     "is red?", _nums(a=(1, 20), b=(1, 20))),
    ("A phone plan costs {a} dollars a month plus {b} cents per text message. How much do I pay in a month when I "
     "send {c} messages?", _nums(a=(10, 40), b=(5, 25), c=(20, 300))),
]  # fmt: skip

MATH_STYLES = [
    "",
    " Explain your reasoning step by step.",
    " Show your working.",
    " Give just the answer first.",
]

# ---------------------------------------------------------------------------------- code
LANGUAGES = [
    "Python",
    "JavaScript",
    "TypeScript",
    "Java",
    "C",
    "C++",
    "Go",
    "Rust",
    "Ruby",
    "C#",
    "Kotlin",
    "PHP",
]

CODE_SUBJECTS = _lines("""
    reverses a string
    checks whether a number is prime
    counts the words in a sentence
    finds the largest number in a list
    converts Celsius to Fahrenheit
    sorts a list of names alphabetically
    removes duplicates from a list
    checks whether a word is a palindrome
    sums the digits of a number
    merges two sorted lists into one sorted list
    computes the factorial of a number
    counts the vowels in a string
    flattens a nested list
    finds the average of a list of numbers
    checks whether an email address looks valid
    capitalizes the first letter of every word in a sentence
    computes the area of a circle from its radius
    returns the elements that two lists have in common
    groups words by their first letter
    finds the second largest number in an array
    checks whether two strings are anagrams
    converts a number to Roman numerals
    converts a binary string to a decimal number
    computes the greatest common divisor of two numbers
    reverses the order of the words in a sentence
    counts how often each character appears in a string
    checks whether a year is a leap year
    finds the longest word in a sentence
    rotates an array by k positions
    returns the n-th prime number
    checks whether a string contains only digits
    removes all whitespace from a string
    finds the missing number in a list containing 1 to n with one number missing
    calculates compound interest
    generates a random password of a given length
    splits a list into chunks of size n
    checks whether the brackets in a string are balanced
    performs binary search on a sorted list
    computes the median of a list of numbers
    counts the lines in a text file
    returns all the even numbers from a list
    raises a number to a power without using a built-in power function
    converts a duration in seconds to hours, minutes and seconds
    checks whether a number is a perfect square
""")

CODE_TASKS = _lines("""
    Write a {lang} function that {s}.
    Show me how to write a function in {lang} that {s}.
    Write a {lang} function that {s}, and explain how it works.
    Can you write a short {lang} program that {s}? Add comments.
    In {lang}, how would I write a function that {s}?
    Write a {lang} function that {s}. Include two example calls.
""")

SNIPPETS = [
    ("Python", "def f(xs):\n    out = []\n    for x in xs:\n        if x % 2 == 0:\n            out.append(x * x)\n"
     "    return out\n\nprint(f([1, 2, 3, 4]))"),
    ("Python", "total = 0\nfor i in range(1, 11):\n    total += i\nprint(total)"),
    ("Python", "def greet(name, excited=False):\n    msg = 'Hello, ' + name\n    if excited:\n        msg += '!'\n"
     "    return msg\n\nprint(greet('Ada', True))"),
    ("Python", "words = 'the cat and the hat'.split()\ncounts = {}\nfor w in words:\n    counts[w] = counts.get(w, 0) + 1"
     "\nprint(counts)"),
    ("Python", "def average(nums):\n    return sum(nums) / len(nums) - 1\n\nprint(average([2, 4, 6]))"),
    ("Python", "class Counter:\n    def __init__(self):\n        self.n = 0\n\n    def tick(self):\n        self.n += 1\n"
     "        return self.n\n\nc = Counter()\nc.tick()\nprint(c.tick())"),
    ("JavaScript", "function countdown(n) {\n  for (let i = n; i > 0; i--) {\n    console.log(i);\n  }\n"
     "  console.log('Go!');\n}\ncountdown(3);"),
    ("JavaScript", "const prices = [5, 12, 8, 20];\nconst cheap = prices.filter(p => p < 10).map(p => p * 2);\n"
     "console.log(cheap);"),
    ("JavaScript", "function isEven(n) {\n  if (n % 2 = 0) {\n    return true;\n  }\n  return false;\n}"),
    ("C", "#include <stdio.h>\n\nint main(void) {\n    int a = 7, b = 3;\n    printf(\"%d %d\\n\", a / b, a % b);\n"
     "    return 0;\n}"),
    ("C", "int max(int *xs, int n) {\n    int best = xs[0];\n    for (int i = 1; i < n; i++)\n"
     "        if (xs[i] > best) best = xs[i];\n    return best;\n}"),
    ("SQL", "SELECT name, COUNT(*) AS orders\nFROM customers JOIN orders ON orders.customer_id = customers.id\n"
     "GROUP BY name\nORDER BY orders DESC\nLIMIT 5;"),
    ("Bash", "for f in *.txt; do\n  wc -l \"$f\"\ndone"),
    ("Rust", "fn main() {\n    let v = vec![3, 1, 2];\n    let mut s = v.clone();\n    s.sort();\n"
     "    println!(\"{:?} {:?}\", v, s);\n}"),
    ("Go", "package main\n\nimport \"fmt\"\n\nfunc main() {\n\tm := map[string]int{\"a\": 1, \"b\": 2}\n"
     "\tfor k, v := range m {\n\t\tfmt.Println(k, v)\n\t}\n}"),
]  # fmt: skip

SNIPPET_TASKS = [
    "Explain what this {lang} code does:\n\n{c}",
    "Add comments to this {lang} code:\n\n{c}",
    "Is there a bug in this {lang} code? If so, fix it.\n\n{c}",
    "Rewrite this {lang} code to make it easier to read:\n\n{c}",
    "What does this {lang} code print or return?\n\n{c}",
    "Translate this {lang} code into {other}:\n\n{c}",
]

SQL_QUERIES = _lines("""
    lists all customers from Canada
    counts the orders placed in 2023
    finds the five most expensive products
    shows the average salary in each department
    finds employees who earn more than their manager
    deletes users who have not logged in for a year
    lists products that have never been ordered
    returns the total sales for each month
    finds duplicate email addresses in a users table
    adds a column for phone numbers to a customers table
    finds the second highest salary
    lists students together with the names of their courses
    counts how many books each author has written
    raises the price of every product in the toys category by 10 percent
    creates a table for storing blog posts
    finds customers who placed more than three orders
    lists all orders placed in the last seven days
    shows how many employees were hired each year
    finds the oldest person in a people table
    returns the names of departments that have no employees
""")

CONCEPTS = _items("""
    recursion, a hash map, object-oriented programming, a linked list, big-O notation, a REST API,
    version control with Git, unit testing, a race condition, garbage collection, a closure, an
    interface, inheritance, dependency injection, a binary tree, a queue, caching, regular expressions,
    JSON, asynchronous programming, threads, a database index, SQL joins, exceptions, type checking, a
    compiler, pointers, a memory leak, a virtual machine, containers such as Docker, continuous
    integration, pure functions, immutability, the model-view-controller pattern, encryption, password
    hashing, floating-point numbers, a command-line interface
""")

CONCEPT_TASKS = _lines("""
    Explain {c} in programming with a simple example.
    What is {c}, and when would I use it?
    Explain {c} to someone who has just started coding.
""")

# ---------------------------------------------------------------------------------- chat
SMALL_TALK = _lines("""
    Hi! How's your day going?
    Good evening! Can you tell me a joke?
    I'm bored. What should I do this afternoon?
    I just adopted a puppy! Any advice for the first week?
    Tell me something that will make me smile.
    I passed my driving test today!
    What's a good question to start a conversation with someone new?
    I'm nervous about a job interview tomorrow. Any words of encouragement?
    Do you have any fun weekend ideas for a family with two kids?
    What's your favourite book, and why?
    I can't decide what to cook for dinner tonight. Any ideas?
    It's raining all day here. What can I do indoors?
    Can you recommend a good film for a cosy night in?
    I had a really long day at work. Can we just chat for a bit?
    My best friend is moving to another city. How can we stay close?
    What do you think makes a good friend?
    Tell me an interesting fact I probably don't know.
    I just finished my exams! How should I celebrate?
    I want to surprise my mum on her birthday. Any ideas?
    Hello there! What can you help me with?
    Can you tell me a riddle?
    What are some fun things to do on a summer evening?
    I'm learning to cook. What's an easy dish to start with?
    I feel a bit lonely today.
    What's the best way to make new friends as an adult?
    Guess what? I ran my first five kilometres today!
    If you could visit any place in the world, where would you go?
    What's something small I can do today to be more productive?
    I'm thinking about getting a cat. What should I know first?
    Give me a fun challenge for today.
    What's a good hobby for someone who sits at a desk all day?
    Tell me a short joke about computers.
    Can you help me think of a fun theme for a party?
    What's a nice thing I could do for my neighbours?
    I just moved into my first apartment!
    How do you stay positive on a bad day?
    Can you suggest a board game for four adults?
    What should I name my new goldfish?
    Tell me a story in five sentences.
    Do you know any good tongue twisters?
    Thanks for your help earlier, it really worked!
    What's a good way to spend a Sunday morning?
    I'm bored of my usual breakfast. What else could I try?
    My plants keep dying. What am I doing wrong?
    I have a free evening. Should I read, watch a film or go for a walk?
    Can you give me a compliment? I need one today.
    What is a good gift for someone who has everything?
    I'm going camping for the first time next week!
    What's one thing you would teach everyone if you could?
    Say something encouraging to a student who just failed a test.
""")

HOBBIES = _items("""
    painting, knitting, rock climbing, photography, running, baking, playing the guitar, chess, yoga,
    birdwatching, gardening, pottery, drawing, dancing, swimming, learning Japanese, writing poetry,
    woodworking, sewing, fishing, hiking, playing the drums, singing, programming, juggling,
    calligraphy, skateboarding, surfing, tennis, magic tricks, journaling, camping, astronomy, cooking
    Thai food, learning the piano, making bread, crocheting, kayaking, origami, bouldering
""")

HOBBY_TASKS = _lines("""
    I just started {h}. Do you have any advice for a beginner?
    I've been {h} for a year and I feel stuck. How can I improve?
    Is {h} a good hobby for someone who is shy?
    What do I need to get started with {h}?
""")

MOODS = ["a bit stressed", "really happy", "tired", "bored", "anxious about my exams", "excited about a trip",
         "unmotivated", "proud of myself"]  # fmt: skip
MOOD_ASKS = [
    "Can you cheer me up?",
    "Any advice?",
    "Can you suggest something to do?",
    "Talk to me for a bit.",
]

SITUATIONS = _lines("""
    I'm 35 and thinking about changing careers from accounting to teaching. What should I consider before deciding?
    My roommate never does the dishes. How can I bring it up without starting a fight?
    I have a job offer with a higher salary but a much longer commute. How should I decide?
    We're planning a picnic for twenty people next Saturday. What food should we bring, and how much?
    My grandfather wants to learn to use a smartphone. How can I teach him patiently?
    I want to read more, but I never finish books. What can I do?
    Our small team keeps missing deadlines. What are some simple changes we could try?
    I have 30 minutes a day to exercise and no equipment. What routine would you suggest?
    My ten-year-old wants a pet. Which pets are good for children, and what responsibilities come with them?
    I'm hosting my partner's parents for the first time. How do I make a good impression?
    I have to choose between studying biology and studying computer science. How can I make up my mind?
    My friend forgot my birthday and I feel hurt. Should I tell her?
    I want to start saving for a trip next summer, but money is tight. Where do I begin?
    My manager gave me harsh feedback in front of the whole team. How should I respond?
    I'm moving to a country where I don't speak the language. How can I prepare in three months?
    Our neighbourhood has no place for teenagers to meet. How could we start a youth club?
    I keep checking my phone when I should be studying. What can I do about it?
    My sister and I argue every time we talk about politics. How can we keep the peace at family dinners?
    I want to run a half marathon in six months, but I can only run 3 km now. Is that realistic?
    I'm organizing a charity quiz night for the first time. What do I need to plan?
    I've been offered a promotion, but it means managing my friends. What should I think about?
    My flat is small and always feels messy. How can I make it feel bigger and tidier?
    I want to learn to draw, but I think I have no talent. Is it worth trying?
    My team speaks four different languages. How can we communicate better in meetings?
    I'm a teacher and my class gets restless after lunch. What activities could help?
    I have three exams in one week. How should I plan my revision?
    My parents want me to become a doctor, but I love music. How can I talk to them about it?
    I'm starting a small online shop selling handmade candles. What should I do first?
    I want to cook more at home instead of ordering food. How do I start?
    I've never voted before. How do I find out who to vote for?
""")

# ---------------------------------------------------------------------------------- how-to
HOWTOS = _items("""
    make a good first impression, write a cover letter, prepare for a job interview, change a flat tyre
    on a car, start running, learn to touch type, keep houseplants alive, plan a birthday party, save
    money on groceries, organize my wardrobe, study for an exam, make friends in a new city, start a
    vegetable garden, make a monthly budget, write a good essay, take better photos with my phone, stop
    procrastinating, learn a new language quickly, clean a cast-iron pan, remove a coffee stain from a
    shirt, improve my handwriting, negotiate a higher salary, give constructive feedback, prepare for a
    long flight, make my home more energy efficient, start a podcast, back up my computer, set up a home
    Wi-Fi network, choose a strong password, train a dog to sit, introduce a new cat to my home, stay
    focused while studying, make pancakes without eggs, cook rice on the stove, plan a week of healthy
    meals, pack a suitcase efficiently, make a presentation more engaging, run a productive meeting,
    deal with a difficult coworker, start journaling, learn to juggle, tie a tie, fold a paper airplane
    that flies far, build a campfire safely, read more books, start meditating, keep a conversation
    going, say no politely, apologize sincerely, write a thank-you note, organize my email inbox, learn
    to code, choose a laptop, speed up a slow computer, memorize a speech, prepare for a marathon, lower
    my stress, stay warm in winter without a big heating bill, keep cool in summer without air
    conditioning, look after a sourdough starter, grow herbs on a windowsill, repot a plant, paint a
    room, hang a picture straight, fix a dripping tap, unclog a sink, sew on a button, iron a shirt,
    fold a fitted sheet, help a child learn to read, support a friend who is going through a hard time,
    write a short story, draw a simple face, look after a goldfish, plan a road trip, learn to swim as
    an adult, make a good cup of coffee at home, start a book club, write a good résumé, sharpen a
    kitchen knife
""")

HOWTO_TASKS = _lines("""
    How do I {h}?
    What's the best way to {h}?
    Give me step-by-step instructions to {h}.
    I want to {h}, but I don't know where to start. Can you help?
    What mistakes do people often make when they try to {h}?
""")

# ---------------------------------------------------------------------------------- compare
PAIRS = [
    ("cats", "dogs as pets"), ("tea", "coffee"), ("weather", "climate"), ("a virus", "a bacterium"),
    ("a lake", "a sea"), ("a crocodile", "an alligator"), ("a comet", "an asteroid"), ("a frog", "a toad"),
    ("a hurricane", "a tornado"), ("renting a home", "buying one"), ("a debit card", "a credit card"),
    ("stocks", "bonds"), ("an e-book", "a printed book"), ("baking soda", "baking powder"),
    ("a violin", "a viola"), ("a democracy", "a monarchy"), ("a simile", "a metaphor"),
    ("'affect'", "'effect'"), ("an introvert", "an extrovert"), ("a mountain", "a hill"),
    ("a rabbit", "a hare"), ("a dolphin", "a porpoise"), ("butter", "margarine"), ("a cold", "the flu"),
    ("a museum", "a gallery"), ("a novel", "a short story"), ("a trumpet", "a trombone"),
    ("a planet", "a star"), ("a moth", "a butterfly"), ("weight", "mass"), ("speed", "velocity"),
    ("an atom", "a molecule"), ("a résumé", "a CV"), ("a stack", "a queue"), ("a compiler", "an interpreter"),
    ("an array", "a linked list"), ("HTTP", "HTTPS"), ("SQL databases", "NoSQL databases"),
    ("Git", "GitHub"), ("a process", "a thread"), ("RAM", "storage"),
    ("front-end development", "back-end development"), ("static typing", "dynamic typing"),
    ("==", "=== in JavaScript"), ("let", "const in JavaScript"), ("a class", "an object"),
    ("TCP", "UDP"), ("an API", "a library"), ("machine learning", "traditional programming"),
    ("a wolf", "a dog"), ("a poem", "a song"), ("a diary", "a blog"), ("jam", "jelly"),
    ("a cyclone", "a typhoon"), ("an ocean", "a sea"), ("a symphony", "a concerto"),
    ("a goal", "a plan"), ("confidence", "arrogance"), ("empathy", "sympathy"), ("a loan", "a grant"),
]  # fmt: skip

PAIR_TASKS = _lines("""
    What is the difference between {a} and {b}?
    Compare {a} and {b} in a short table.
    Explain the difference between {a} and {b} with an example.
    People often confuse {a} and {b}. How can I tell them apart?
""")

# ---------------------------------------------------------------------------------- writing
MESSAGES = [
    ("my landlord", "asking to fix the heating"), ("a teacher", "thanking her for extra help before the exams"),
    ("my manager", "asking for a day off next Friday"), ("a customer", "apologizing for a late delivery"),
    ("my neighbours", "inviting them to a small garden party"),
    ("a hotel", "asking whether they have a room with a sea view"),
    ("a colleague", "congratulating him on his promotion"), ("a friend", "saying I can't come to her wedding"),
    ("my team", "announcing a new weekly meeting"), ("the city council", "about a broken street light"),
    ("a company", "applying for an internship"), ("my son's school", "explaining that he was ill yesterday"),
    ("a restaurant", "booking a table for eight people"), ("a client", "sending the final version of a report"),
    ("a former colleague", "asking for a reference"), ("an online shop", "asking for a refund for a damaged item"),
    ("a new employee", "welcoming her to the team"), ("my gym", "cancelling my membership"),
    ("my book club", "suggesting the next book to read"), ("my grandparents", "thanking them for their visit"),
    ("a professor", "asking for an extension on an assignment"), ("a plumber", "asking for a price estimate"),
    ("a job candidate", "telling him that the position has been filled"),
    ("my landlord", "giving notice that I'm moving out"),
    ("the organizers of a conference", "asking about vegetarian meals"),
    ("a neighbour", "asking them to keep the music down in the evening"),
    ("my team", "thanking everyone after a difficult project"), ("a supplier", "asking why an order is late"),
    ("a friend", "recommending a book I loved"), ("my doctor's office", "asking to move an appointment"),
]  # fmt: skip

MESSAGE_FORMS = _lines("""
    Write a short email to {who} {what}.
    Write a polite letter to {who} {what}.
    Draft a friendly message to {who} {what}.
    Help me write a text message to {who} {what}. Keep it short.
""")

STORY_FORMS = ["a short story", "a poem", "a limerick", "a song chorus", "a fairy tale", "a fable with a moral",
               "a bedtime story", "a scene for a play"]  # fmt: skip

STORY_THEMES = _items("""
    a lost umbrella, a robot learning to paint, the first day at a new school, a dragon who is afraid of
    the dark, a city under the sea, two friends who find an old map, a cat who becomes mayor, the last
    tree in a desert, a talking clock, a rainy afternoon, a grandmother's garden, a spaceship that runs
    out of fuel, a shy giant, a lighthouse keeper, a snowman in spring, an old key, a lost letter, the
    smell of fresh bread, a journey across the ocean, a library at midnight, a kite that wants to fly
    higher, a detective who is a dog, the day the internet stopped, a village without music, a boy who
    can talk to birds, an unexpected friendship, a message in a bottle, the first snow of winter, a
    train that never stops, a brave little mouse
""")

# ---------------------------------------------------------------------------------- words
WORDS = _items("""
    resilient, ambiguous, meticulous, nostalgia, serendipity, pragmatic, eloquent, ephemeral, candid,
    diligent, frugal, inevitable, obsolete, reluctant, versatile, vivid, tedious, benevolent, humble,
    generous, sincere, cautious, clumsy, elegant, fragile, genuine, hesitant, immense, jovial, lenient,
    modest, notorious, optimistic, peculiar, quaint, robust, subtle, thorough, vague, wary, gratitude,
    empathy, integrity, patience
""")

WORD_TASKS = [
    "What does the word '{w}' mean? Use it in a sentence.",
    "Give me three synonyms for '{w}' and explain how they differ.",
]

IDIOMS = _items("""
    break the ice, a piece of cake, hit the nail on the head, under the weather, spill the beans, once
    in a blue moon, the ball is in your court, bite off more than you can chew, cost an arm and a leg,
    let the cat out of the bag, on thin ice, call it a day, cut corners, get cold feet, in hot water,
    miss the boat, pull someone's leg, see eye to eye, the tip of the iceberg, when pigs fly, burn the
    midnight oil, every cloud has a silver lining, actions speak louder than words, don't count your
    chickens before they hatch, kill two birds with one stone
""")

PLACES = _items("""
    Paris, Tokyo, Rome, New York, Barcelona, Iceland, Kyoto, Lisbon, Cape Town, Mexico City, Istanbul,
    Vienna, Prague, Sydney, Buenos Aires, Marrakech, Amsterdam, Edinburgh, Bangkok, Seoul, Vancouver,
    the Swiss Alps, Crete, Hanoi, Berlin, Copenhagen, Lima, Nairobi, Budapest, Dubrovnik
""")

PLACE_TASKS = _lines("""
    Plan a three-day trip to {p}.
    What should a first-time visitor to {p} see and eat?
    Make a packing list for a week in {p}.
""")

NAMED = _items("""
    a pet rabbit, a podcast about history, a hiking club, a mobile app that tracks habits, a board game
    about space, a robot vacuum cleaner, a school newsletter, a sailing boat, a kingdom in a fantasy
    novel, a new flavour of ice cream, a family group chat, a jazz band, a second-hand bookshop, a
    startup that sells houseplants, a superhero who controls the weather, a gardening blog, a chess
    club, a charity fun run, a video game character, a travel vlog, a newly discovered planet, a reading
    challenge, a neighbourhood festival, a food truck that sells tacos, a team of volunteer firefighters
""")

NAME_TASKS = ["Brainstorm five names for {x}, with one sentence on each.", "Give me a catchy name for {x}."]


# ---------------------------------------------------------------------------------- assembly
def _maths(rng: random.Random, per_template: int = 24) -> list[str]:
    out = []
    for template, numbers in MATHS:
        out += [template.format(**numbers(rng)) + rng.choice(MATH_STYLES) for _ in range(per_template)]
    return out


def _code() -> list[str]:
    out = [t.format(lang=lang, s=s) for t, lang, s in itertools.product(CODE_TASKS, LANGUAGES, CODE_SUBJECTS)]
    for (lang, code), task in itertools.product(SNIPPETS, SNIPPET_TASKS):
        others = ["Python", "JavaScript", "Go"] if "{other}" in task else [""]
        out += [task.format(lang=lang, c=code, other=o) for o in others if o != lang]
    out += [f"Write an SQL query that {q}." for q in SQL_QUERIES]
    out += [f"Write an SQL query that {q}, and explain each part." for q in SQL_QUERIES]
    out += [t.format(c=c) for t, c in itertools.product(CONCEPT_TASKS, CONCEPTS)]
    return out


def prompt_families(seed: int = 0) -> dict[str, tuple[float, list[str]]]:
    """Every family's share and its prompts (before exclusion and shuffling)."""
    rng = random.Random(seed)
    chat = SMALL_TALK + SITUATIONS + [t.format(h=h) for t, h in itertools.product(HOBBY_TASKS, HOBBIES)]
    chat += [f"I'm feeling {m} today. {a}" for m, a in itertools.product(MOODS, MOOD_ASKS)]
    writing = [f.format(who=w, what=x) for f, (w, x) in itertools.product(MESSAGE_FORMS, MESSAGES)]
    writing += [f"Write {f} about {t}." for f, t in itertools.product(STORY_FORMS, STORY_THEMES)]
    words = [t.format(w=w) for t, w in itertools.product(WORD_TASKS, WORDS)]
    words += [f"Explain the idiom '{i}' and give an example of how to use it." for i in IDIOMS]
    words += [t.format(p=p) for t, p in itertools.product(PLACE_TASKS, PLACES)]
    words += [t.format(x=x) for t, x in itertools.product(NAME_TASKS, NAMED)]
    return {
        "topics": (0.24, [t.format(s=s) for t, s in itertools.product(TOPIC_TASKS, SUBJECTS)]),
        "constrained": (
            0.10,
            [f"{q.format(s=s)} {c}" for q, c, s in itertools.product(QUESTIONS, CONSTRAINTS, SUBJECTS)],
        ),
        "texts": (0.08, [t.format(t=x) for t, x in itertools.product(TEXT_TASKS, TEXTS)]),
        "maths": (0.09, _maths(rng)),
        "code": (0.16, _code()),
        "chat": (0.08, chat),
        "how-to": (0.07, [t.format(h=h) for t, h in itertools.product(HOWTO_TASKS, HOWTOS)]),
        "compare": (0.04, [t.format(a=a, b=b) for t, (a, b) in itertools.product(PAIR_TASKS, PAIRS)]),
        "writing": (0.08, writing),
        "words": (0.06, words),
    }


def _excluded() -> set[str]:
    path = os.path.join(os.path.dirname(__file__), "assets", "train_prompts.txt")
    with open(path, encoding="utf-8") as f:
        return {ln.strip() for ln in f if ln.strip() and not ln.startswith("#")}


def mixed_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct prompts (at most as many as the families hold), drawn family by family in
    the shares of the module docstring and shuffled with ``seed``."""
    rng = random.Random(seed)
    skip = _excluded()
    seen: set[str] = set()
    pools: dict[str, list[str]] = {}
    families = prompt_families(seed)
    for name, (_, prompts) in families.items():
        keep = []
        for p in prompts:
            if p not in seen and p not in skip and not any(a in p.lower() for a in _AVOID):
                seen.add(p)
                keep.append(p)
        rng.shuffle(keep)
        pools[name] = keep
    shares = {name: share for name, (share, _) in families.items()}
    n = min(max(n, 0), len(seen))
    taken = {name: min(len(pools[name]), round(n * shares[name])) for name in pools}
    while sum(taken.values()) > n:  # rounding up in every family
        taken[max(taken, key=taken.__getitem__)] -= 1
    while sum(taken.values()) < n:  # families that ran out leave their share to the others
        name = max(pools, key=lambda k: (len(pools[k]) - taken[k]) / max(len(pools[k]), 1))
        taken[name] += 1
    out = [p for name, pool in pools.items() for p in pool[: taken[name]]]
    rng.shuffle(out)
    return out
