"""More training prompts for the EAGLE head: task templates crossed with subjects.

The hand-written ``train_prompts.txt`` has about two hundred prompts; a draft head learns the
target's habits (how it opens an answer, lists, code, explanations) from the target's own answers,
and more varied prompts give it more of them. ``mixed_prompts(n, seed)`` crosses the task templates
below with the subjects below (both written for this project) and returns ``n`` distinct prompts in a
seeded order. The held-out prompts of ``train_prompts.txt`` are never produced here.
"""

from __future__ import annotations

import itertools
import random

__all__ = ["mixed_prompts"]

TASKS = [
    "Explain {s} to a beginner.",
    "Write a short story about {s}.",
    "List five facts about {s}.",
    "What are the pros and cons of {s}?",
    "Write a short poem about {s}.",
    "Give me three practical tips about {s}.",
    "Summarize the history of {s} in one paragraph.",
    "Describe {s} in simple words for a child.",
    "Write a product description for something related to {s}.",
    "What are common misconceptions about {s}?",
    "Write a friendly email to a colleague about {s}.",
    "Create a quiz with three questions about {s}, with answers.",
    "Compare {s} with something similar and explain the differences.",
    "Why is {s} important?",
    "Write a dialogue between two friends talking about {s}.",
    "Give a step-by-step guide to getting started with {s}.",
    "What would the world look like without {s}?",
    "Write a limerick about {s}.",
    "Describe a day in the life of someone who works with {s}.",
    "What questions should I ask an expert on {s}?",
    "Write a short speech to introduce {s} to an audience.",
    "Give me an outline for an essay about {s}.",
    "Explain {s} using an analogy.",
    "What are three interesting numbers related to {s}?",
    "Write a haiku about {s}.",
    "How has {s} changed in the last hundred years?",
    "Write a JSON object describing {s} with a name, a category and three tags.",
    "Tell me a fun fact about {s} and explain why it is true.",
    "What are the main parts of {s}?",
    "Write a review of a book about {s}.",
]

CODE_TASKS = [
    "Write a Python function that {s}.",
    "Write a JavaScript function that {s}.",
    "Explain how to write a program that {s}.",
    "Write a Python function that {s}, with a docstring and an example.",
    "Write a unit test for a function that {s}.",
]

SUBJECTS = [
    "the moon", "coffee", "volcanoes", "the internet", "honeybees", "rainforests", "electric cars",
    "the Roman Empire", "chess", "photosynthesis", "black holes", "the human heart", "origami",
    "jazz music", "recycling", "the ocean tides", "bread baking", "solar panels", "the printing press",
    "penguins", "mountain climbing", "public libraries", "vaccines", "the French language", "bicycles",
    "clouds", "the stock market", "ancient Egypt", "gardening", "earthquakes", "friendship", "robots",
    "tea ceremonies", "the Olympic Games", "dinosaurs", "the piano", "airplanes", "deserts",
    "time management", "meditation", "the periodic table", "snowflakes", "coral reefs", "video games",
    "trains", "cheese making", "the Great Wall of China", "lighthouses", "kites", "rivers",
    "the immune system", "money", "maps", "volunteering", "owls", "glass making", "the violin",
    "thunderstorms", "spices", "the water cycle", "public speaking", "castles", "recipes for soup",
    "sleep", "bridges", "comets", "museums", "cats", "dogs", "whales", "pizza", "the alphabet",
    "birthdays", "umbrellas", "football", "climate change", "typewriters", "satellites", "mushrooms",
]

CODE_SUBJECTS = [
    "reverses a string", "checks whether a number is prime", "counts the words in a sentence",
    "finds the largest number in a list", "converts Celsius to Fahrenheit", "sorts a list of names",
    "removes duplicates from a list", "checks whether a word is a palindrome", "sums the digits of a number",
    "merges two sorted lists", "computes a factorial", "returns the n-th Fibonacci number",
    "counts the vowels in a text", "flattens a nested list", "finds the average of a list of numbers",
    "validates an email address", "capitalizes every word of a sentence", "computes the area of a circle",
    "returns the common elements of two lists", "groups words by their first letter",
]


def mixed_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct prompts (at most the number of combinations), shuffled with ``seed``."""
    pool = [t.format(s=s) for t, s in itertools.product(TASKS, SUBJECTS)]
    pool += [t.format(s=s) for t, s in itertools.product(CODE_TASKS, CODE_SUBJECTS)]
    random.Random(seed).shuffle(pool)
    return pool[: max(n, 0)]
