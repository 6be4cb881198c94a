"""Object words for CHAIR: COCO's 80 categories and the words that name them.

Data only; :mod:`vlm_focus.eval.chair` reads it. Each category lists the words or two-word
phrases that mention it, in singular form (mentions are singularised before lookup, and two-word
names are matched before single words, as the CHAIR rules of docs/protocols.md ask).
Categories of other sets (the organism's ``red_circle`` etc.) are named by their own name only.
"""

from __future__ import annotations

# One category a line: its name, a colon, then the words that mention it (a line that starts
# with spaces continues the one above).
_SYNONYM_LINES = """
person: person, people, man, woman, boy, girl, child, kid, baby, guy, lady, gentleman, adult,
    teenager, player, skier, surfer, skateboarder, snowboarder, rider, biker, cyclist,
    pedestrian, crowd, toddler, worker, chef, cook, police officer, policeman, officer,
    soldier, student, tourist, passenger, spectator, batter, catcher, umpire
bicycle: bicycle, bike, cycle, mountain bike
car: car, automobile, sedan, taxi, cab, vehicle, suv, jeep, van
motorcycle: motorcycle, motorbike, motor bike, scooter, moped, dirt bike
airplane: airplane, plane, aeroplane, jet, aircraft, airliner, jumbo jet
bus: bus, double decker, school bus, shuttle
train: train, locomotive, subway, tram, railcar, passenger train
truck: truck, pickup, pickup truck, lorry, fire truck
boat: boat, ship, sailboat, canoe, kayak, yacht, ferry, raft, vessel
traffic light: traffic light, traffic signal, stop light, stoplight
fire hydrant: fire hydrant, hydrant
stop sign: stop sign
parking meter: parking meter
bench: bench, park bench
bird: bird, pigeon, seagull, gull, duck, goose, parrot, owl, eagle, sparrow, swan, crow, hen,
    chicken, penguin, flamingo
cat: cat, kitten, kitty
dog: dog, puppy, pup, doggy
horse: horse, pony, foal, stallion, mare
sheep: sheep, lamb, ram, ewe
cow: cow, cattle, bull, calf, ox, oxen, steer
elephant: elephant
bear: bear, grizzly, polar bear, brown bear, black bear
zebra: zebra
giraffe: giraffe
backpack: backpack, back pack, knapsack, rucksack
umbrella: umbrella, parasol
handbag: handbag, purse, hand bag, tote
tie: tie, necktie, bow tie
suitcase: suitcase, suit case, luggage, briefcase
frisbee: frisbee, flying disc
skis: ski, skis
snowboard: snowboard, snow board
sports ball: ball, sports ball, soccer ball, football, basketball, tennis ball
kite: kite
baseball bat: baseball bat, bat
baseball glove: baseball glove, glove, mitt, baseball mitt
skateboard: skateboard, skate board
surfboard: surfboard, surf board, paddleboard
tennis racket: tennis racket, racket, racquet, tennis racquet
bottle: bottle, water bottle, wine bottle, beer bottle
wine glass: wine glass, wineglass
cup: cup, mug, coffee cup, teacup, tea cup
fork: fork
knife: knife, knives
spoon: spoon
bowl: bowl
banana: banana
apple: apple
sandwich: sandwich, burger, hamburger, panini
orange: orange, tangerine, mandarin
broccoli: broccoli
carrot: carrot
hot dog: hot dog, hotdog, frankfurter
pizza: pizza
donut: donut, doughnut
cake: cake, cupcake, birthday cake, cheesecake
chair: chair, stool, armchair
couch: couch, sofa, loveseat
potted plant: potted plant, houseplant, house plant, plant, flower pot
bed: bed
dining table: dining table, table, desk, kitchen table, coffee table
toilet: toilet, urinal, commode
tv: tv, television, tv screen, flat screen
laptop: laptop, notebook computer, computer, netbook
mouse: mouse, computer mouse
remote: remote, remote control, controller, game controller
keyboard: keyboard
cell phone: cell phone, cellphone, phone, mobile phone, smartphone, iphone
microwave: microwave
oven: oven, stove
toaster: toaster
sink: sink
refrigerator: refrigerator, fridge, freezer
book: book, novel, textbook
clock: clock
vase: vase
scissors: scissor, scissors
teddy bear: teddy bear, teddy, stuffed animal, stuffed bear
hair drier: hair drier, hair dryer, hairdryer, blow dryer, blowdryer
toothbrush: toothbrush, tooth brush
"""

# Plurals that a suffix rule gets wrong, as "plural singular" pairs.
_PLURAL_PAIRS = """
people people, men man, women woman, children child, kids kid, knives knife, mice mouse, geese
goose, oxen oxen, calves calf, teeth tooth, feet foot, skis ski, scissors scissors, buses bus,
glasses glass, bookshelves bookshelf, shelves shelf, leaves leaf, benches bench, sandwiches
sandwich, couches couch, watches watch, boxes box, foxes fox, dishes dish, brushes brush,
toothbrushes toothbrush, species species, sheep sheep, broccoli broccoli
"""


def _synonyms(text: str) -> dict[str, tuple[str, ...]]:
    entries = text.strip().replace("\n    ", " ").splitlines()
    table = {}
    for entry in entries:
        name, _, words = entry.partition(":")
        table[name.strip()] = tuple(w.strip() for w in words.split(","))
    return table


COCO_SYNONYMS: dict[str, tuple[str, ...]] = _synonyms(_SYNONYM_LINES)
IRREGULAR_PLURALS: dict[str, str] = dict(
    pair.split() for pair in _PLURAL_PAIRS.replace("\n", " ").split(",")
)
