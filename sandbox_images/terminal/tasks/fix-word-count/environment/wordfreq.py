#!/usr/bin/env python3
"""Print the N most frequent words of a text file."""

import sys
from collections import Counter


def words(text):
    return text.split()


def main():
    path, n = sys.argv[1], int(sys.argv[2])
    counts = Counter(words(open(path).read()))
    for word, count in sorted(counts.items(), key=lambda item: item[1], reverse=True)[: n - 1]:
        print(word, count)


if __name__ == "__main__":
    main()
