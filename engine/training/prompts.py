"""Rebuild `configs/train_prompts.jsonl` (`python -m engine.training.prompts`): the hand-written prompts plus
templates x topics, wide rather than deep, deterministic, and without any prompt of
`configs/train_prompts_heldout.jsonl` (the benchmark's).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from engine.training.assistant import read_prompts

ROOT = Path(__file__).resolve().parents[2]

TEMPLATES = [
    "Give me a brief history of {}.", "Write a short paragraph about {}.",
    "What are the pros and cons of {}?",
    "How would you explain {} to a ten-year-old?", "Summarize the key ideas of {} for a beginner.",
    "Write a short story that involves {}.", "What are three interesting facts about {}?",
    "Give me some tips related to {}.", "Explain {} in simple terms.", "Why is {} important?",
    "List five questions a student might ask about {}.", "Write a haiku about {}.",
    "What are common misconceptions about {}?", "Describe {} in three sentences.",
    "Write a short blog post introduction about {}.", "What should a beginner know about {}?",
]

TOPICS = """DNA|Mars|Shakespeare|airplanes|antibiotics|baking bread|bicycles|black holes|budget travel
|camping|chess
|climate change|cloud computing|coffee|composting|democracy|dinosaurs|electric cars|email etiquette|friendship
|glaciers|gravity|growing tomatoes|healthy breakfast ideas|honey bees|inflation|jazz music|job interviews
|learning a new language|machine learning|meditation|origami|passwords and online security|penguins
|photosynthesis|public speaking|rainbows|recycling|robots|running a marathon|saving money|sharks|sleep
|solar panels|starting a small business|tea|the Amazon rainforest|the French Revolution
|the Great Wall of China|the Moon|the Olympic Games|the Renaissance|the Roman Empire|the human heart
|the immune system|the internet|the moon landing|the ocean tides|the periodic table|the piano
|the printing press|the speed of light|the stock market|time management|vaccines|video games|volcanoes
|volunteering|wind turbines|writing a resume|yoga|earthquakes|hurricanes|the water cycle|electricity
|magnets|the solar system|comets|the Milky Way|telescopes|microscopes|bacteria|viruses|the brain
|the digestive system|bones and muscles|nutrition|drinking water|exercise|swimming|football|basketball
|tennis|cycling safety|hiking|gardening|houseplants|bird watching|cats|dogs|horses|elephants|whales
|octopuses|butterflies|ants|coral reefs|deserts|rivers|mountains|forests|the Arctic|Antarctica|islands
|ancient Egypt|ancient Greece|the Vikings|the Middle Ages|the Industrial Revolution|the Silk Road
|world maps|castles|pyramids|the steam engine|the telephone|television|radio|photography|cinema
|painting|sculpture|poetry|novels|libraries|museums|classical music|rock music|learning the guitar
|singing|dancing|theater|cooking pasta|making pizza|chocolate|cheese|rice|spices|vegetarian diets
|food safety|kitchen hygiene|sourdough|fermentation|coding interviews|Python programming|JavaScript
|databases|spreadsheets|operating systems|computer networks|cybersecurity|open source software
|artificial intelligence|smartphones|3D printing|virtual reality|electric batteries|nuclear energy
|hydropower|fossil fuels|carbon footprints|air pollution|plastic waste|water conservation|urban planning
|public transport|trains|ships|rockets|satellites|the International Space Station|weather forecasting
|clouds|snow|lightning|seasons|calendars|time zones|clocks|mathematics|fractions|prime numbers
|geometry|probability|statistics|algebra|the scientific method|chemistry experiments|acids and bases
|atoms|light and color|sound waves|renewable energy|banking|credit cards|taxes|budgeting|investing
|negotiation|leadership|teamwork|remote work|writing emails|note taking|studying for exams|homework
|reading habits|handwriting|learning math|kindness|patience|gratitude|stress management|habits
|goal setting|first aid|brushing teeth|vaccination schedules|hand washing|sunscreen|recipes for soup
|wildlife photography|board games|puzzles|magic tricks|birthday parties|weddings|holidays|moving house
|renting an apartment|buying a car|road trips|packing for a trip|airports|hotels|maps and navigation"""


def build() -> list[str]:
    held = set(read_prompts(ROOT / "configs" / "train_prompts_heldout.jsonl"))
    original = read_prompts(ROOT / "configs" / "train_prompts.jsonl")
    shapes = [re.compile(re.escape(t).replace(r"\{\}", ".+")) for t in TEMPLATES]
    hand = [p for p in original if not any(s.fullmatch(p) for s in shapes)]  # free-form, kept as is
    topics = [t.strip() for t in TOPICS.replace("\n", "").split("|") if t.strip()]
    templated = sorted({t.format(topic) for t in TEMPLATES for topic in topics} - held - set(hand))
    random.Random(0).shuffle(templated)  # any prefix of the file mixes templates and topics
    return hand + templated


def main() -> None:
    prompts = build()
    out = ROOT / "configs" / "train_prompts.jsonl"
    out.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    print(f"{len(prompts)} prompts -> {out}")


if __name__ == "__main__":
    main()
