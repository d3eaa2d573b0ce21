"""Structured output with a real model (issue 32): 50 JSON schemas, a pydantic parse and tool calls.

    .venv/bin/python evals/schemas.py [--max-tokens 300] [--concurrency 16]

Issue 32 asks that, with Qwen2.5-Coder-0.5B-Instruct served, JSON schemas of varied shape are
each answered by JSON that parses and validates against its schema, every one, greedy and
sampled; that the openai client's `beta.chat.completions.parse` with a pydantic model returns a
parsed object; and that a tools request with tool_choice "required" returns a tool call whose
arguments validate. This script is that check, through the real `openai` client against the
server (`create_app`) on a loopback port, the engine as the README serves it (the Q4_K_M GGUF,
int8 activations, max_batch 16).

The 50 schemas (`SCHEMAS`, each a name, a short user prompt asking for that kind of object and
the schema) are the kinds of object an application asks a model for: a book, a recipe, an order,
a flight, a DNS record. Between them they cover nested objects (three levels in the shipping
label), arrays with minItems and maxItems (of strings, numbers, enums and objects), enums
(of strings, and of numbers), required and optional fields, integers and numbers with
minimum, maximum, exclusiveMinimum and exclusiveMaximum, strings with maxLength, minLength and
pattern, booleans, nullable fields (anyOf with null), const, a union of two object shapes, $defs
and $ref, a top-level array, and additionalProperties false on every object but one. Every free
string has a maxLength and every array a maxItems, so an answer is bounded: a small model may
otherwise write a string until max_tokens cuts it, and a cut answer is not JSON. With the bounds,
max_tokens 300 is enough for every answer here (the CSV's `tokens` column shows how far each
went); an answer cut by max_tokens would be counted invalid with finish_reason "length", not
dropped. The bounds hold only where the schema sets them: the one open object (dns_record,
additionalProperties left out) lets the model add keys of its own with strings of any length,
and at temperature 1.5 (beyond what this script asks) it did, until max_tokens 400 cut it; at
0.8 and greedy it keeps to the schema's keys.

Each schema is sent as `response_format` {"type": "json_schema"} twice: greedy (temperature 0)
and sampled (temperature 0.8, top_p 0.95, seed the schema's index), all 100 requests from 16
threads at once, so the engine batches them as it would any traffic. An answer counts as valid
when `json.loads` takes its content and `jsonschema.validate` passes it (jsonschema's default
validator, which reads `pattern` but not `format`). Six more go through vLLM's `guided_json`
field (in `extra_body`), greedy, to show that field reaches the same grammar. The prompt names
the object's fields, as an application's would; the schema itself is not in the prompt, so the
grammar, not the model's reading of it, is what keeps the answer valid (unconstrained, the model
wraps its JSON in a markdown fence: tests/test_structured_qwen.py checks that those answers do
not all validate).

Then `client.beta.chat.completions.parse(..., response_format=Book)` (a pydantic model with an
enum list, bounds and a nested optional object): `.choices[0].message.parsed` must be a Book.
And tools: three functions with JSON-schema parameters (get_weather, search_flights,
convert_currency) offered to 10 prompts with tool_choice "required", and to 3 of them with the
function named: each answer must carry tool_calls whose `function.arguments` parse and validate
against that function's parameters (the named one's name must match), with finish_reason
"tool_calls". The same 10 prompts with tool_choice "auto" are only counted: how often the model
calls a tool of its own accord (and whether those calls validate); a 0.5B model need not. Where
it does not, the answer is also checked for a call written as plain JSON outside Qwen's
<tool_call> tags (bare or in a markdown fence), which the server, like vLLM's hermes parser,
leaves as content: in the run the CSV holds, that is what the model wrote to all ten.

It prints the CPU line every benchmark prints, a summary table, and writes evals/schemas.csv: one
row per request (section schema, guided_json, parse, tools: the case, the mode, valid 0/1, the
finish_reason, the completion tokens, the seconds the request took, the answer, and why it did
not validate if it did not) and summary rows (section summary: valid/total per mode, completion
tokens per second over the schema phase, parse ok, tools ok). The machine is shared and has 2
cores, so the timings are indicative only; the valid counts are the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal, NamedTuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from nanocourse import write_csv  # noqa: E402
from nanoserve.bench import cpu_line  # noqa: E402

MODEL = "qwen2.5-coder-0.5b-instruct"  # the registry's name (fetch.py)
SERVED = "Qwen2.5-Coder-0.5B-Instruct"  # the name the server answers to
MAX_TOKENS = 300
CONCURRENCY = 16
SAMPLED = {"temperature": 0.8, "top_p": 0.95}


def obj(properties: dict, required=None, **extra) -> dict:
    """An object schema with no properties beyond `properties`, all of them required unless
    `required` names fewer."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
        **extra,
    }


def text(n: int, **extra) -> dict:
    """A string of at most n characters (at least 1)."""
    return {"type": "string", "minLength": 1, "maxLength": n, **extra}


def pattern(p: str) -> dict:
    return {"type": "string", "pattern": p}


def integer(lo=None, hi=None, **extra) -> dict:
    s = {"type": "integer", **extra}
    if lo is not None:
        s["minimum"] = lo
    if hi is not None:
        s["maximum"] = hi
    return s


def number(lo=None, hi=None, **extra) -> dict:
    s = {"type": "number", **extra}
    if lo is not None:
        s["minimum"] = lo
    if hi is not None:
        s["maximum"] = hi
    return s


def enum(*values) -> dict:
    return {"type": "string", "enum": list(values)}


def array(items: dict, lo: int = 0, hi: int = 5) -> dict:
    return {"type": "array", "items": items, "minItems": lo, "maxItems": hi}


def nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


BOOL = {"type": "boolean"}
DATE = pattern(r"^[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$")
TIME = pattern(r"^([01][0-9]|2[0-3]):[0-5][0-9]$")
EMAIL = pattern(r"^[a-z0-9._]{1,20}@[a-z0-9]{1,15}\.[a-z]{2,3}$")
NAME = text(40)


class Case(NamedTuple):
    name: str
    prompt: str
    schema: dict


SCHEMAS = [
    Case(
        "book",
        "Invent a book: its title, author, year of publication, up to three genres and whether it is in "
        "print.",
        obj(
            {
                "title": text(80),
                "author": NAME,
                "year": integer(1450, 2025),
                "genres": array(
                    enum(
                        "fiction",
                        "mystery",
                        "science fiction",
                        "fantasy",
                        "biography",
                        "history",
                        "poetry",
                        "romance",
                    ),
                    1,
                    3,
                ),
                "in_print": BOOL,
            }
        ),
    ),
    Case(
        "person",
        "Describe a fictional person: name, age, email address and, if they have one, a phone number.",
        obj(
            {
                "name": NAME,
                "age": integer(0, 120),
                "email": EMAIL,
                "phone": nullable(pattern(r"^\+?[0-9]{7,12}$")),
            },
            required=["name", "age", "email"],
        ),
    ),
    Case(
        "recipe",
        "Write a simple recipe: its name, servings, two to five ingredients with quantity and unit, "
        "and whether it is vegetarian.",
        obj(
            {
                "name": text(60),
                "servings": integer(1, 12),
                "ingredients": array(
                    obj(
                        {
                            "item": text(30),
                            "quantity": number(exclusiveMinimum=0, maximum=1000),
                            "unit": enum("g", "kg", "ml", "l", "cup", "tbsp", "tsp", "piece"),
                        }
                    ),
                    2,
                    5,
                ),
                "vegetarian": BOOL,
            }
        ),
    ),
    Case(
        "movie",
        "Invent a movie: title, director, release year, a rating out of 10 and its genres.",
        obj(
            {
                "title": text(60),
                "director": NAME,
                "release_year": integer(1900, 2030),
                "rating": number(0, 10),
                "genres": array(
                    enum("action", "comedy", "drama", "horror", "thriller", "animation", "documentary"), 1, 3
                ),
            }
        ),
    ),
    Case(
        "weather_report",
        "Give a weather report for a city: temperature in Celsius, condition, humidity percent "
        "and wind speed in km/h.",
        obj(
            {
                "city": NAME,
                "temperature_c": number(-60, 60),
                "condition": enum("sunny", "cloudy", "rain", "snow", "fog", "storm"),
                "humidity": integer(0, 100),
                "wind_kph": number(0, 300),
            }
        ),
    ),
    Case(
        "product",
        "Describe a product in an online shop: name, SKU like ABC-1234, price, currency and a few tags.",
        obj(
            {
                "name": text(60),
                "sku": pattern(r"^[A-Z]{3}-[0-9]{4}$"),
                "price": number(exclusiveMinimum=0, maximum=10000),
                "currency": enum("USD", "EUR", "GBP", "JPY"),
                "tags": array(text(20), 0, 4),
            }
        ),
    ),
    Case(
        "address",
        "Give a postal address: street, city, postal code and country code.",
        obj(
            {
                "street": text(60),
                "city": NAME,
                "postal_code": pattern(r"^[0-9]{5}$"),
                "country": enum("US", "DE", "FR", "IT", "ES", "MX"),
            }
        ),
    ),
    Case(
        "order",
        "Create an online order: an order id like ORD-123456, the customer's name and email, one to "
        "four items (SKU, quantity, unit price) and its status.",
        obj(
            {
                "order_id": pattern(r"^ORD-[0-9]{6}$"),
                "customer": obj({"name": NAME, "email": EMAIL}),
                "items": array(
                    obj(
                        {
                            "sku": pattern(r"^[A-Z]{3}-[0-9]{4}$"),
                            "qty": integer(1, 20),
                            "unit_price": number(exclusiveMinimum=0, maximum=5000),
                        }
                    ),
                    1,
                    4,
                ),
                "status": enum("pending", "paid", "shipped", "delivered", "cancelled"),
            }
        ),
    ),
    Case(
        "employee",
        "Describe an employee: name, department, yearly salary, their manager's name (or none) and "
        "start date.",
        obj(
            {
                "name": NAME,
                "department": enum("engineering", "sales", "marketing", "finance", "hr", "support"),
                "salary": integer(20000, 500000),
                "manager": nullable(NAME),
                "start_date": DATE,
            }
        ),
    ),
    Case(
        "event",
        "Plan an event: title, date, start time, duration in minutes, venue and city, and whether it "
        "is online.",
        obj(
            {
                "title": text(60),
                "date": DATE,
                "start_time": TIME,
                "duration_minutes": integer(15, 480),
                "location": obj({"venue": text(40), "city": NAME}),
                "online": BOOL,
            }
        ),
    ),
    Case(
        "flight",
        "Describe a flight: flight number, origin and destination airport codes, departure date, "
        "seats left and cabin class.",
        obj(
            {
                "flight_number": pattern(r"^[A-Z]{2}[0-9]{2,4}$"),
                "origin": pattern(r"^[A-Z]{3}$"),
                "destination": pattern(r"^[A-Z]{3}$"),
                "departure": DATE,
                "seats_left": integer(0, 400),
                "cabin": enum("economy", "premium", "business", "first"),
            }
        ),
    ),
    Case(
        "bug_report",
        "File a bug report for a web app: title, severity, component, steps to reproduce and "
        "whether it is reproducible.",
        obj(
            {
                "title": text(80),
                "severity": enum("low", "medium", "high", "critical"),
                "component": enum("frontend", "backend", "database", "auth", "api"),
                "steps": array(text(60), 1, 4),
                "reproducible": BOOL,
            }
        ),
    ),
    Case(
        "sentiment",
        "Classify the sentiment of: 'The battery lasts all day but the screen scratches easily.' "
        "Give a label, a confidence and up to three keywords.",
        obj(
            {
                "label": enum("positive", "negative", "neutral", "mixed"),
                "confidence": number(0, 1),
                "keywords": array(text(20), 0, 3),
            }
        ),
    ),
    Case(
        "planet",
        "Describe a planet of the solar system: name, number of moons, mass in Earth masses, "
        "whether it has rings and the main gases of its atmosphere.",
        obj(
            {
                "name": enum("Mercury", "Venus", "Earth", "Mars", "Jupiter", "Saturn", "Uranus", "Neptune"),
                "moons": integer(0, 200),
                "mass_earths": number(exclusiveMinimum=0, maximum=400),
                "has_rings": BOOL,
                "atmosphere": array(
                    enum("hydrogen", "helium", "nitrogen", "oxygen", "carbon dioxide", "methane", "argon"),
                    0,
                    4,
                ),
            }
        ),
    ),
    Case(
        "pet",
        "Describe a pet: name, species, age in years, whether it is vaccinated, and its owner's name "
        "and phone if it has an owner.",
        obj(
            {
                "name": text(20),
                "species": enum("dog", "cat", "rabbit", "parrot", "hamster", "fish"),
                "age_years": number(0, 30),
                "vaccinated": BOOL,
                "owner": nullable(obj({"name": NAME, "phone": pattern(r"^[0-9]{7,12}$")})),
            }
        ),
    ),
    Case(
        "car",
        "Describe a used car for sale: make, model, year, fuel type, mileage in km and color.",
        obj(
            {
                "make": text(20),
                "model": text(20),
                "year": integer(1950, 2025),
                "fuel": enum("petrol", "diesel", "electric", "hybrid"),
                "mileage_km": integer(0, 1000000),
                "color": text(20),
            }
        ),
    ),
    Case(
        "invoice",
        "Write an invoice: invoice number like INV-2024-001, one to four line items with a "
        "description and amount, the tax rate, whether it is paid and the due date.",
        obj(
            {
                "invoice_number": pattern(r"^INV-[0-9]{4}-[0-9]{3}$"),
                "line_items": array(
                    obj({"description": text(50), "amount": number(exclusiveMinimum=0, maximum=100000)}), 1, 4
                ),
                "tax_rate": number(0, 0.3),
                "paid": BOOL,
                "due_date": DATE,
            }
        ),
    ),
    Case(
        "song",
        "Invent a song: title, artist, duration in seconds, tempo in BPM and musical key.",
        obj(
            {
                "title": text(50),
                "artist": NAME,
                "duration_seconds": integer(30, 900),
                "bpm": integer(40, 220),
                "key": enum("C", "C#", "D", "Eb", "E", "F", "F#", "G", "Ab", "A", "Bb", "B"),
            }
        ),
    ),
    Case(
        "hotel_booking",
        "Book a hotel room: guest name, check-in date, number of nights, room type, adults "
        "and children, and whether breakfast is included.",
        obj(
            {
                "guest": NAME,
                "check_in": DATE,
                "nights": integer(1, 30),
                "room_type": enum("single", "double", "twin", "suite"),
                "guests": obj({"adults": integer(1, 4), "children": integer(0, 4)}),
                "breakfast": BOOL,
            }
        ),
    ),
    Case(
        "course",
        "Describe a university course: code like CS101, title, credits, prerequisite course codes and level.",
        obj(
            {
                "code": pattern(r"^[A-Z]{2,4}[0-9]{3}$"),
                "title": text(60),
                "credits": integer(1, 6),
                "prerequisites": array(pattern(r"^[A-Z]{2,4}[0-9]{3}$"), 0, 3),
                "level": enum("introductory", "intermediate", "advanced", "graduate"),
            }
        ),
    ),
    Case(
        "server_config",
        "Write a web server configuration: hostname, port, whether TLS is on, log level, "
        "maximum connections and allowed origins.",
        obj(
            {
                "hostname": pattern(r"^[a-z0-9-]{1,20}(\.[a-z0-9-]{1,20}){0,3}$"),
                "port": integer(1, 65535),
                "tls": BOOL,
                "log_level": enum("debug", "info", "warning", "error"),
                "max_connections": integer(1, 10000),
                "allowed_origins": array(pattern(r"^https?://[a-z0-9.-]{1,30}$"), 0, 3),
            }
        ),
    ),
    Case(
        "github_issue",
        "Open a GitHub issue: title, labels, assignee (or nobody), priority from 1 to 5 and state.",
        obj(
            {
                "title": text(80),
                "labels": array(enum("bug", "enhancement", "docs", "question", "good first issue"), 0, 3),
                "assignee": nullable(pattern(r"^[a-z0-9-]{1,20}$")),
                "priority": integer(1, 5),
                "state": enum("open", "closed"),
            }
        ),
    ),
    Case(
        "country",
        "Give facts about a country: name, capital, population, continent and up to three official "
        "languages.",
        obj(
            {
                "name": NAME,
                "capital": NAME,
                "population": integer(exclusiveMinimum=0, maximum=2000000000),
                "continent": enum("Africa", "Asia", "Europe", "North America", "South America", "Oceania"),
                "languages": array(text(20), 1, 3),
            }
        ),
    ),
    Case(
        "workout",
        "Plan a workout: type, duration in minutes, calories burned and one to four exercises with "
        "sets and reps.",
        obj(
            {
                "type": enum("strength", "cardio", "yoga", "hiit"),
                "duration_min": integer(5, 180),
                "calories": integer(0, 2000),
                "exercises": array(
                    obj({"name": text(30), "sets": integer(1, 10), "reps": integer(1, 50)}), 1, 4
                ),
            }
        ),
    ),
    Case(
        "restaurant_review",
        "Review a restaurant: its name, stars from 1 to 5, price level, dishes tried and "
        "whether you would return.",
        obj(
            {
                "restaurant": NAME,
                "stars": integer(1, 5),
                "price_level": enum("$", "$$", "$$$", "$$$$"),
                "dishes": array(text(30), 1, 3),
                "would_return": BOOL,
            }
        ),
    ),
    Case(
        "transaction",
        "Record a bank transaction: id like TX-00001234, amount, currency, debit or credit, "
        "the merchant if any, and a timestamp.",
        obj(
            {
                "id": pattern(r"^TX-[0-9]{8}$"),
                "amount": number(exclusiveMinimum=0, maximum=1000000),
                "currency": enum("USD", "EUR", "GBP"),
                "type": enum("debit", "credit"),
                "merchant": nullable(NAME),
                "timestamp": pattern(r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z$"),
            }
        ),
    ),
    Case(
        "rpg_character",
        "Create a role-playing game character: name, class, level, strength, dexterity and "
        "intelligence scores, and up to five inventory items.",
        obj(
            {
                "name": text(30),
                "class": enum("warrior", "mage", "rogue", "cleric", "ranger"),
                "level": integer(1, 20),
                "stats": obj(
                    {"strength": integer(3, 18), "dexterity": integer(3, 18), "intelligence": integer(3, 18)}
                ),
                "inventory": array(text(30), 0, 5),
            }
        ),
    ),
    Case(
        "nutrition",
        "Give the nutrition facts of a granola bar: calories, grams of protein, fat and carbs, "
        "and its allergens.",
        obj(
            {
                "food": text(40),
                "calories": integer(0, 3000),
                "protein_g": number(0, 200),
                "fat_g": number(0, 200),
                "carbs_g": number(0, 500),
                "allergens": array(enum("gluten", "nuts", "peanuts", "milk", "eggs", "soy", "fish"), 0, 4),
            }
        ),
    ),
    Case(
        "shipping_label",
        "Make a shipping label: sender and recipient, each with a name and an address "
        "(street, city, zip), the weight in kg and whether it is express.",
        {
            "$defs": {
                "party": obj(
                    {
                        "name": NAME,
                        "address": obj({"street": text(50), "city": text(30), "zip": pattern(r"^[0-9]{5}$")}),
                    }
                )
            },
            **obj(
                {
                    "sender": {"$ref": "#/$defs/party"},
                    "recipient": {"$ref": "#/$defs/party"},
                    "weight_kg": number(exclusiveMinimum=0, maximum=70),
                    "express": BOOL,
                }
            ),
        },
    ),
    Case(
        "meeting_notes",
        "Take notes of a team meeting: topic, attendees, decisions and action items with an "
        "owner, a task and a due date if any.",
        obj(
            {
                "topic": text(60),
                "attendees": array(text(30), 1, 5),
                "decisions": array(text(60), 0, 3),
                "action_items": array(
                    obj({"owner": text(30), "task": text(60), "due": nullable(DATE)}), 0, 3
                ),
            }
        ),
    ),
    Case(
        "stock_quote",
        "Give a stock quote: ticker, price, percent change today, volume and exchange.",
        obj(
            {
                "ticker": pattern(r"^[A-Z]{1,5}$"),
                "price": number(exclusiveMinimum=0, maximum=100000),
                "change_pct": number(-100, 100),
                "volume": integer(0, 10000000000),
                "exchange": enum("NYSE", "NASDAQ", "LSE", "TSE"),
            }
        ),
    ),
    Case(
        "job_posting",
        "Post a job: title, company, whether it is remote, a salary range, seniority and one to "
        "five required skills.",
        obj(
            {
                "title": text(50),
                "company": NAME,
                "remote": BOOL,
                "salary": obj({"min": integer(10000, 1000000), "max": integer(10000, 1000000)}),
                "seniority": enum("junior", "mid", "senior", "lead"),
                "skills": array(text(25), 1, 5),
            }
        ),
    ),
    Case(
        "element",
        "Describe a chemical element: symbol, name, atomic number, atomic mass, state at room "
        "temperature and whether it is a metal.",
        obj(
            {
                "symbol": pattern(r"^[A-Z][a-z]?$"),
                "name": text(20),
                "atomic_number": integer(1, 118),
                "atomic_mass": number(exclusiveMinimum=0, maximum=300),
                "state": enum("solid", "liquid", "gas"),
                "metal": BOOL,
            }
        ),
    ),
    Case(
        "todo_list",
        "Write a to-do list of one to five tasks, each with whether it is done and a priority.",
        array(obj({"task": text(50), "done": BOOL, "priority": enum("low", "medium", "high")}), 1, 5),
    ),
    Case(
        "user_profile",
        "Create a user profile: username, display name, age if given, interests and whether "
        "they want the newsletter.",
        obj(
            {
                "username": pattern(r"^[a-z0-9_]{3,16}$"),
                "display_name": text(30),
                "age": nullable(integer(13, 120)),
                "interests": array(text(20), 0, 4),
                "newsletter": BOOL,
            },
            required=["username", "display_name", "newsletter"],
        ),
    ),
    Case(
        "api_error",
        "Return an API error for a request that was rate limited: HTTP status code, error type, "
        "message and seconds to wait before retrying.",
        obj(
            {
                "status": integer(400, 599),
                "error": enum("bad_request", "unauthorized", "not_found", "rate_limited", "server_error"),
                "message": text(80),
                "retry_after": nullable(integer(0, 3600)),
            }
        ),
    ),
    Case(
        "geo_point",
        "Give a famous landmark's location: its name, latitude, longitude and elevation in meters if known.",
        obj(
            {
                "name": NAME,
                "lat": number(-90, 90),
                "lon": number(-180, 180),
                "elevation_m": nullable(number(-500, 9000)),
            }
        ),
    ),
    Case(
        "library_loan",
        "Record a library loan: the book's ISBN-13, member id like M-12345, loan date, due "
        "date, renewals so far and whether it is overdue.",
        obj(
            {
                "isbn": pattern(r"^97[89][0-9]{10}$"),
                "member_id": pattern(r"^M-[0-9]{5}$"),
                "loan_date": DATE,
                "due_date": DATE,
                "renewals": integer(0, 3),
                "overdue": BOOL,
            }
        ),
    ),
    Case(
        "quiz_question",
        "Write a multiple-choice quiz question about geography with four options, the index "
        "of the right answer and its difficulty.",
        obj(
            {
                "question": text(100),
                "options": array(text(40), 4, 4),
                "answer_index": integer(0, 3),
                "difficulty": enum("easy", "medium", "hard"),
            }
        ),
    ),
    Case(
        "translation",
        "Translate 'Good morning, how are you?' into French, giving the source and target "
        "languages and both texts.",
        obj(
            {
                "source_lang": enum("en", "fr", "de", "es", "it"),
                "target_lang": enum("en", "fr", "de", "es", "it"),
                "source_text": text(80),
                "translated_text": text(80),
            }
        ),
    ),
    Case(
        "medication",
        "Describe a common medication: name, dose in mg, how often it is taken, whether with "
        "food, and up to three side effects.",
        obj(
            {
                "name": text(30),
                "dose_mg": number(exclusiveMinimum=0, maximum=2000),
                "frequency": enum("once daily", "twice daily", "three times daily", "as needed"),
                "with_food": BOOL,
                "side_effects": array(text(30), 0, 3),
            }
        ),
    ),
    Case(
        "playlist",
        "Make a playlist: its name, whether it is public, and one to five tracks with title, artist "
        "and length in seconds.",
        obj(
            {
                "name": text(40),
                "public": BOOL,
                "tracks": array(
                    obj({"title": text(40), "artist": text(30), "seconds": integer(30, 900)}), 1, 5
                ),
            }
        ),
    ),
    Case(
        "color_palette",
        "Design a color palette: a name, three to five colors as hex codes like #1a2b3c, and its mood.",
        obj(
            {
                "name": text(30),
                "colors": array(pattern(r"^#[0-9a-fA-F]{6}$"), 3, 5),
                "mood": enum("calm", "energetic", "warm", "cool", "dark"),
            }
        ),
    ),
    Case(
        "sports_match",
        "Report a finished match: the sport, home and away teams with their scores, its "
        "status and whether it went to overtime.",
        obj(
            {
                "sport": enum("football", "basketball", "hockey", "baseball"),
                "home": obj({"team": NAME, "score": integer(0, 200)}),
                "away": obj({"team": NAME, "score": integer(0, 200)}),
                "status": enum("final", "abandoned", "postponed"),
                "overtime": BOOL,
            }
        ),
    ),
    Case(
        "house_listing",
        "List a house for sale: address, bedrooms, bathrooms (halves allowed), price, a few "
        "features, and whether it is sold.",
        obj(
            {
                "address": text(60),
                "bedrooms": integer(0, 10),
                "bathrooms": {"enum": [1, 1.5, 2, 2.5, 3, 3.5, 4]},
                "price": integer(exclusiveMinimum=0, maximum=50000000),
                "features": array(
                    enum("garage", "garden", "pool", "fireplace", "basement", "solar panels"), 0, 4
                ),
                "sold": BOOL,
            }
        ),
    ),
    Case(
        "meeting_slot",
        "Propose a meeting across time zones: two to four participants with their time zone, "
        "the duration in minutes and a start time in UTC.",
        obj(
            {
                "participants": array(
                    obj(
                        {
                            "name": text(30),
                            "timezone": enum(
                                "UTC",
                                "America/New_York",
                                "Europe/London",
                                "Europe/Berlin",
                                "Asia/Tokyo",
                                "Australia/Sydney",
                            ),
                        }
                    ),
                    2,
                    4,
                ),
                "duration_min": {"type": "integer", "enum": [15, 30, 45, 60, 90]},
                "start_utc": pattern(r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}Z$"),
            }
        ),
    ),
    Case(
        "ci_pipeline",
        "Define a CI pipeline: its name, what triggers it, and one to three stages, each with a "
        "name, one to three shell commands and whether it may fail.",
        obj(
            {
                "name": text(30),
                "trigger": enum("push", "pull_request", "schedule", "manual"),
                "stages": array(
                    obj({"name": text(20), "commands": array(text(60), 1, 3), "allow_failure": BOOL}), 1, 3
                ),
            }
        ),
    ),
    Case(
        "survey_response",
        "Fill in a customer survey: respondent id, satisfaction from 1 to 10, whether they "
        "would recommend us, a comment (or none) and how they heard of us.",
        obj(
            {
                "respondent_id": integer(exclusiveMinimum=0, maximum=999999),
                "satisfaction": integer(1, 10),
                "recommend": BOOL,
                "comment": nullable(text(120)),
                "channels": array(enum("search", "social", "friend", "ad", "other"), 1, 3),
            }
        ),
    ),
    Case(
        "payment",
        "Record how a customer paid: either by card (last four digits and expiry month/year) or by "
        "bank transfer (IBAN), and the amount.",
        obj(
            {
                "method": {
                    "anyOf": [
                        obj(
                            {
                                "kind": {"const": "card"},
                                "last4": pattern(r"^[0-9]{4}$"),
                                "expiry": pattern(r"^(0[1-9]|1[0-2])/[0-9]{2}$"),
                            }
                        ),
                        obj(
                            {
                                "kind": {"const": "bank_transfer"},
                                "iban": pattern(r"^[A-Z]{2}[0-9]{2}[A-Z0-9]{10,30}$"),
                            }
                        ),
                    ]
                },
                "amount": number(exclusiveMinimum=0, exclusiveMaximum=100000),
            }
        ),
    ),
    Case(
        "dns_record",
        "Write a DNS record for example.com: domain, type, TTL in seconds, value and, for MX, a priority.",
        {
            "type": "object",
            "properties": {
                "domain": pattern(r"^([a-z0-9-]{1,30}\.){1,3}[a-z]{2,6}$"),
                "type": enum("A", "AAAA", "CNAME", "MX", "TXT"),
                "ttl": integer(60, 86400),
                "value": text(60),
                "priority": nullable(integer(0, 65535)),
            },
            "required": ["domain", "type", "ttl", "value"],
        },
    ),  # the one open object: extra keys allowed
]

# vLLM's field, in extra_body: a few of the same schemas, greedy
GUIDED_JSON = ("book", "order", "shipping_label", "payment", "todo_list", "dns_record")


# --- the pydantic model for beta.chat.completions.parse ---


def book_model():
    """A pydantic model (defined here so importing the module needs no pydantic at module level)."""
    from pydantic import BaseModel, Field

    class Publisher(BaseModel):
        name: str = Field(max_length=40)
        city: str = Field(max_length=30)

    class Book(BaseModel):
        title: str = Field(max_length=80)
        author: str = Field(max_length=40)
        year: int = Field(ge=1450, le=2025)
        genres: list[Literal["fiction", "mystery", "fantasy", "history", "poetry"]] = Field(
            min_length=1, max_length=3
        )
        pages: int = Field(gt=0, le=2000)
        publisher: Publisher | None

    return Book


PARSE_PROMPT = "Invent a book: title, author, year, genres, page count and its publisher (name and city)."


# --- tools ---


def tool(name: str, description: str, parameters: dict) -> dict:
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


# parameters as applications write them: no maxLength on the strings
TOOLS = [
    tool(
        "get_weather",
        "Get the current weather in a city.",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    ),
    tool(
        "search_flights",
        "Search for flights between two airports on a date.",
        {
            "type": "object",
            "properties": {
                "origin": {"type": "string", "pattern": "^[A-Z]{3}$", "description": "IATA code"},
                "destination": {"type": "string", "pattern": "^[A-Z]{3}$", "description": "IATA code"},
                "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["origin", "destination", "date"],
            "additionalProperties": False,
        },
    ),
    tool(
        "convert_currency",
        "Convert an amount of money from one currency to another.",
        {
            "type": "object",
            "properties": {
                "amount": {"type": "number", "exclusiveMinimum": 0},
                "from": {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY", "CHF"]},
                "to": {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY", "CHF"]},
            },
            "required": ["amount", "from", "to"],
            "additionalProperties": False,
        },
    ),
]
TOOL_PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
# (prompt, the function it is about)
TOOL_PROMPTS = [
    ("What's the weather like in Paris right now?", "get_weather"),
    ("Is it raining in Tokyo? Tell me in fahrenheit.", "get_weather"),
    ("How cold is it in Oslo today?", "get_weather"),
    ("Find me a flight from JFK to LHR on 2025-07-14.", "search_flights"),
    ("I need two seats from SFO to NRT on 2025-09-01.", "search_flights"),
    ("Are there flights from Berlin (BER) to Madrid (MAD) next Friday, 2025-05-16?", "search_flights"),
    ("Convert 250 euros to US dollars.", "convert_currency"),
    ("How many yen is 40 pounds?", "convert_currency"),
    ("What is 1000 Swiss francs in euros?", "convert_currency"),
    ("I'm flying to Rome tomorrow; what's the weather there?", "get_weather"),
]
NAMED = (0, 3, 6)  # prompts also asked with their function named in tool_choice


# --- requests ---


def validate(content: str | None, schema: dict) -> str | None:
    """None if `content` is JSON that validates against `schema`, else why not."""
    import jsonschema

    try:
        data = json.loads(content or "")
    except json.JSONDecodeError as e:
        return f"not JSON: {e}"
    try:
        jsonschema.validate(data, schema)
    except jsonschema.ValidationError as e:
        return f"invalid: {e.message}"
    return None


def response_format(case: Case) -> dict:
    return {"type": "json_schema", "json_schema": {"name": case.name, "schema": case.schema}}


def sampling(mode: str, seed: int) -> dict:
    return {"temperature": 0.0} if mode == "greedy" else {**SAMPLED, "seed": seed}


def ask_schema(
    client, case: Case, mode: str, seed: int, max_tokens: int, via: str = "response_format"
) -> dict:
    """One schema request; its CSV row."""
    kw = {"response_format": response_format(case)} if via == "response_format" else {}
    if via == "guided_json":
        kw["extra_body"] = {"guided_json": case.schema}
    t = time.perf_counter()
    r = client.chat.completions.create(
        model=SERVED,
        messages=[{"role": "user", "content": case.prompt}],
        max_tokens=max_tokens,
        **sampling(mode, seed),
        **kw,
    )
    seconds = time.perf_counter() - t
    choice = r.choices[0]
    why = validate(choice.message.content, case.schema)
    row = dict(
        section="schema" if via == "response_format" else via,
        case=case.name,
        mode=mode,
        valid=int(why is None),
        finish_reason=choice.finish_reason,
        tokens=r.usage.completion_tokens,
        seconds=round(seconds, 2),
    )
    row["answer"] = choice.message.content
    if why is not None:
        row["note"] = why[:300]
    return row


def ask_tools(client, prompt: str, tool_choice, max_tokens: int, stream: bool = False):
    """A tools request (greedy); (finish_reason, tool calls as (name, arguments text), content, tokens)."""
    messages = [{"role": "user", "content": prompt}]
    if not stream:
        r = client.chat.completions.create(
            model=SERVED,
            messages=messages,
            tools=TOOLS,
            tool_choice=tool_choice,
            temperature=0.0,
            max_tokens=max_tokens,
        )
        m = r.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
        return r.choices[0].finish_reason, calls, m.content, r.usage.completion_tokens
    parts: dict[int, list] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(
        model=SERVED,
        messages=messages,
        tools=TOOLS,
        tool_choice=tool_choice,
        temperature=0.0,
        max_tokens=max_tokens,
        stream=True,
    ):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            name_args = parts.setdefault(tc.index, ["", ""])
            if tc.function is not None:
                name_args[0] += tc.function.name or ""
                name_args[1] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    calls = [tuple(parts[i]) for i in sorted(parts)]
    return finish, calls, content or None, None


def call_in_content(content: str | None) -> bool:
    """Whether `content` is a call written as plain JSON, outside Qwen's <tool_call> tags (in a
    markdown fence or bare): {"name": one of TOOLS, "arguments": valid for it}. The server reads
    only tagged calls, as vLLM's hermes parser does, so such an answer has no tool_calls."""
    body = (content or "").strip().removeprefix("```json").removeprefix("```").removesuffix("```")
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return False
    if not isinstance(data, dict) or data.get("name") not in TOOL_PARAMS:
        return False
    return validate(json.dumps(data.get("arguments")), TOOL_PARAMS[data["name"]]) is None


def check_calls(calls, named: str | None = None) -> str | None:
    """None if there is a call and every call's arguments validate against its function's parameters."""
    if not calls:
        return "no tool call"
    for name, arguments in calls:
        if name not in TOOL_PARAMS:
            return f"unknown function {name!r}"
        if named is not None and name != named:
            return f"called {name}, not the named {named}"
        why = validate(arguments, TOOL_PARAMS[name])
        if why is not None:
            return f"{name}: {why}"
    return None


# --- the run ---


def serve():
    """The engine as the README serves Qwen2.5-Coder (a context manager yielding the URL)."""
    import contextlib

    from nanocourse import ServerThread
    from nanoserve.config import EngineConfig
    from nanoserve.engine import build_engine
    from nanoserve.serve import create_app

    @contextlib.contextmanager
    def served():
        eng = build_engine(
            EngineConfig(
                model=MODEL, weights="gguf", quant_activations="int8", max_batch=16, max_model_len=4096
            )
        )
        with ServerThread(create_app(eng)) as url:
            yield url

    return served()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    ap.add_argument("--concurrency", type=int, default=CONCURRENCY)
    ap.add_argument("--out", default=str(HERE / "schemas.csv"))
    args = ap.parse_args(argv)
    import jsonschema
    import openai

    for case in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(case.schema)
    assert len({c.name for c in SCHEMAS}) == len(SCHEMAS) == 50
    print(cpu_line())
    rows: list[dict] = [dict(section="env", metric="cpu", note=cpu_line())]
    by_name = {c.name: c for c in SCHEMAS}
    with serve() as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=900)
        # one request first: it builds llguidance's tokenizer (about a second), outside the timing
        ask_schema(client, SCHEMAS[0], "greedy", 0, 1)
        jobs = [(c, mode, i) for mode in ("greedy", "sampled") for i, c in enumerate(SCHEMAS)]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            schema_rows = list(pool.map(lambda j: ask_schema(client, *j, args.max_tokens), jobs))
        wall = time.perf_counter() - t0
        rows += schema_rows
        with ThreadPoolExecutor(args.concurrency) as pool:
            guided_rows = list(
                pool.map(
                    lambda n: ask_schema(client, by_name[n], "greedy", 0, args.max_tokens, via="guided_json"),
                    GUIDED_JSON,
                )
            )
        rows += guided_rows

        Book = book_model()
        t = time.perf_counter()
        parsed = client.beta.chat.completions.parse(
            model=SERVED,
            messages=[{"role": "user", "content": PARSE_PROMPT}],
            response_format=Book,
            temperature=0.0,
            max_tokens=args.max_tokens,
        )
        p = parsed.choices[0].message.parsed
        parse_ok = int(isinstance(p, Book))
        rows.append(
            dict(
                section="parse",
                case="Book",
                mode="greedy",
                valid=parse_ok,
                finish_reason=parsed.choices[0].finish_reason,
                tokens=parsed.usage.completion_tokens,
                seconds=round(time.perf_counter() - t, 2),
                note=repr(p)[:300],
            )
        )

        tool_jobs = [("required", i, "required") for i in range(len(TOOL_PROMPTS))]
        tool_jobs += [
            ("named", i, {"type": "function", "function": {"name": TOOL_PROMPTS[i][1]}}) for i in NAMED
        ]
        tool_jobs += [("auto", i, "auto") for i in range(len(TOOL_PROMPTS))]

        def run_tool(job):
            kind, i, choice = job
            t = time.perf_counter()
            finish, calls, content, tokens = ask_tools(client, TOOL_PROMPTS[i][0], choice, args.max_tokens)
            named = TOOL_PROMPTS[i][1] if kind == "named" else None
            why = check_calls(calls, named)
            ok = why is None and finish == "tool_calls"
            row = dict(
                section="tools",
                case=f"{kind}:{i}",
                mode=kind,
                valid=int(ok),
                finish_reason=finish,
                tokens=tokens,
                seconds=round(time.perf_counter() - t, 2),
                called=int(bool(calls)),
                call_in_content=int(call_in_content(content)),
                note=json.dumps(calls)[:300] if ok else f"{why or finish} | {calls} | {content!r}"[:400],
            )
            return row

        with ThreadPoolExecutor(args.concurrency) as pool:
            tool_rows = list(pool.map(run_tool, tool_jobs))
        rows += tool_rows

    summary = []
    print(f"\n{'check':34s} {'valid':>9s}  {'length cut':>10s}")
    for label, subset in (
        ("schemas, greedy", [r for r in schema_rows if r["mode"] == "greedy"]),
        ("schemas, sampled", [r for r in schema_rows if r["mode"] == "sampled"]),
        ("guided_json (extra_body), greedy", guided_rows),
        ("tools, tool_choice required", [r for r in tool_rows if r["mode"] == "required"]),
        ("tools, named function", [r for r in tool_rows if r["mode"] == "named"]),
    ):
        ok = sum(r["valid"] for r in subset)
        cut = sum(r["finish_reason"] == "length" for r in subset)
        print(f"{label:34s} {ok:>4d}/{len(subset):<4d}  {cut:>10d}")
        summary.append(dict(section="summary", case=label, metric="valid", value=ok, total=len(subset)))
    auto = [r for r in tool_rows if r["mode"] == "auto"]
    called = sum(r["called"] for r in auto)
    auto_ok = sum(r["valid"] for r in auto)
    in_content = sum(r["call_in_content"] for r in auto)
    print(f"{'tools, auto: called a tool':34s} {called:>4d}/{len(auto):<4d}  (of those, {auto_ok} validate)")
    print(
        f"{'tools, auto: a call as plain JSON':34s} {in_content:>4d}/{len(auto):<4d}  (no <tool_call> tags)"
    )
    print(f"{'beta.chat.completions.parse':34s} {parse_ok:>4d}/1     {p!r}"[:200])
    tokens = sum(r["tokens"] for r in schema_rows)
    per_s = tokens / wall
    mean_tokens = tokens / len(schema_rows)
    print(
        f"\nschema phase: {len(schema_rows)} requests, {tokens:,} completion tokens in {wall:.1f} s "
        f"({per_s:.1f} tok/s over {args.concurrency} concurrent requests; {mean_tokens:.0f} tokens an "
        f"answer, max {max(r['tokens'] for r in schema_rows)})"
    )
    summary += [
        dict(section="summary", case="tools, auto", metric="called", value=called, total=len(auto)),
        dict(
            section="summary", case="tools, auto", metric="called_and_valid", value=auto_ok, total=len(auto)
        ),
        dict(
            section="summary", case="tools, auto", metric="call_in_content", value=in_content, total=len(auto)
        ),
        dict(section="summary", case="parse", metric="parsed", value=parse_ok, total=1),
        dict(section="summary", case="schemas", metric="tokens_per_s", value=round(per_s, 1)),
        dict(section="summary", case="schemas", metric="completion_tokens", value=tokens),
        dict(section="summary", case="schemas", metric="wall_s", value=round(wall, 1)),
        dict(section="summary", case="schemas", metric="max_tokens", value=args.max_tokens),
        dict(section="summary", case="schemas", metric="concurrency", value=args.concurrency),
    ]
    bad = [r for r in schema_rows + guided_rows if not r["valid"]]
    for r in bad:
        what = f"{r['section']} {r['case']} {r['mode']} ({r['finish_reason']})"
        print(f"  INVALID {what}: {r.get('note', '')[:300]}")
    for r in tool_rows:
        if r["mode"] != "auto" and not r["valid"]:
            print(f"  TOOLS FAILED {r['case']} ({r['finish_reason']}): {r['note'][:300]}")
    print(f"\nwrote {write_csv(rows + summary, args.out)}")


if __name__ == "__main__":
    main()
