"""Write a synthetic French weather log: a fine-tuning text unlike the embedded corpus.

    python scripts/weather_log.py OUT.txt [--days 60] [--seed 0]

One line per town and day, e.g.::

    Mardi 2 janvier 2024, Besançon : ciel voilé, 4,6 °C, vent d'ouest à 17 km/h, humidité 81 %.

The text is the same for the same arguments. Its accented letters (é, è, ç, ô, ...) are not in
the Python help text the default run trains on, so fine-tuning on it extends the vocabulary.
"""
from __future__ import annotations

import argparse
import datetime
import math
import random
from pathlib import Path
from typing import List

WEEKDAYS = ["Lundi", "Mardi", "Mercredi", "Jeudi", "Vendredi", "Samedi", "Dimanche"]
MONTHS = ["janvier", "février", "mars", "avril", "mai", "juin", "juillet", "août",
          "septembre", "octobre", "novembre", "décembre"]
# town -> offset of its mean temperature from the national one, in °C
TOWNS = {"Besançon": -1.5, "Orléans": 0.0, "Nîmes": 3.0, "Angoulême": 1.0, "Saint-Étienne": -2.0,
         "Mâcon": -0.5, "Sète": 3.5, "Fréjus": 4.0, "Périgueux": 0.5, "Épinal": -2.5}
SKIES = ["ciel dégagé", "ciel voilé", "nuageux", "très nuageux", "averses éparses",
         "pluie faible", "brouillard matinal", "orages en soirée", "éclaircies"]
WINDS = ["du nord", "du nord-est", "d'est", "du sud-est", "du sud", "du sud-ouest", "d'ouest",
         "du nord-ouest"]
REMARKS = ["Prévision : éclaircies l'après-midi.", "Températures en baisse demain.",
           "Vigilance jaune pour les crues.", "Gelée blanche possible à l'aube.",
           "Qualité de l'air médiocre.", "Fin de l'épisode pluvieux prévue jeudi.",
           "Rafales à 60 km/h sur les hauteurs.", "Pollen : risque élevé.",
           "Neige au-dessus de 800 m.", "Journée très ensoleillée."]


def weather_log(days: int = 60, seed: int = 0) -> str:
    """``days`` days of reports for every town, from 1 January 2024."""
    rng = random.Random(seed)
    lines: List[str] = []
    start = datetime.date(2024, 1, 1)
    for offset in range(days):
        date = start + datetime.timedelta(days=offset)
        season = -math.cos(2 * math.pi * (offset + 10) / 365)  # coldest in early January
        heading = f"{WEEKDAYS[date.weekday()]} {date.day} {MONTHS[date.month - 1]} {date.year}"
        for town, warmer in TOWNS.items():
            temperature = 12.0 + 9.0 * season + warmer + rng.gauss(0, 2.5)
            humidity = max(20, min(100, int(rng.gauss(75 - 2 * temperature / 3, 8))))
            line = (f"{heading}, {town} : {rng.choice(SKIES)}, "
                    f"{temperature:.1f}".replace(".", ",")
                    + f" °C, vent {rng.choice(WINDS)} à {rng.randint(0, 45)} km/h, "
                      f"humidité {humidity} %.")
            if rng.random() < 0.3:
                line += " " + rng.choice(REMARKS)
            lines.append(line)
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="where to write the text (UTF-8)")
    parser.add_argument("--days", type=int, default=60, help="days of reports (default 60)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    args = parser.parse_args()
    text = weather_log(args.days, args.seed)
    args.out.write_text(text, encoding="utf-8")
    print(f"{args.out}: {len(text)} characters, {len(set(text))} distinct")


if __name__ == "__main__":
    main()
