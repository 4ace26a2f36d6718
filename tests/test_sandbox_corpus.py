"""An honest corpus: >= 200 correct solutions in varied styles, scored 1.0 in both modes.

Each of the tasks below is solved several ways (plain loops, comprehensions and functional
tools, recursion and memoization, classes, dataclasses, NamedTuples and Enums, generators, the
standard library's itertools / collections / heapq / bisect / math / statistics / fractions /
decimal / re / string / datetime / operator / functools, ``from __future__ import annotations``,
closures, an optional numpy, in-place mutation of arguments, callable arguments, ValueError on
bad input, Markdown-fenced answers with prose around them, as a chat model writes). Every case is
scored through the code reward exactly as training scores it (a benchmark-tests answer from
``codesets.tests_answer``, the two-process harness, the default limits), in both isolation modes,
and must score 1.0. A second test runs every case as a plain Python program in a fresh
interpreter, which proves the corpus itself is right: a case that passes there and fails in the
sandbox is a harness bug (those, if any, are listed in KNOWN_GAPS with the reason).

To keep the file fast, each mode scores the whole corpus in one ``score_completions`` batch (a
module-scoped fixture), and the plain check runs every case in one interpreter, each in its own
fresh globals.
"""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
from textwrap import dedent

import pytest

from miles_core.data import codesets
from miles_core.rewards.code import Score, score_completions
from miles_core.rewards.pool import SandboxPool

MODES = ("bwrap_shared", "bwrap")
# name -> (completion, entry function name, test snippet); the snippet calls `candidate`
CASES: dict[str, tuple[str, str, str]] = {}
# (mode, name) -> the Score reason of a correct case the sandbox fails (a harness bug); xfail strict
KNOWN_GAPS: dict[tuple[str, str], str] = {}

_PROSE = itertools.cycle([
    ("Here is a solution:", "It also handles the empty input."),
    ("Sure! The idea is simple, see the comments.", "Let me know if you need anything else."),
    ("We can solve this directly.\n\n**Approach**", "**Complexity:** linear in the size of the input."),
    ("```\nexample only, not code\n```\n\nThe implementation:", "This passes the given tests."),
])


def _fenced(code: str) -> str:
    """A completion as a chat model writes it: prose, a ```python block, more prose."""
    before, after = next(_PROSE)
    return f"{before}\n\n```python\n{dedent(code).strip()}\n```\n\n{after}\n"


def _task(entry: str, test: str, **styles: str) -> None:
    for style, code in styles.items():
        CASES[f"{entry}-{style}"] = (dedent(code).lstrip("\n"), entry, dedent(test).strip() + "\n")


_RAISES = """
    try:
        candidate({args})
    except ValueError:
        pass
    else:
        raise AssertionError('expected ValueError')
    """  # indented like the asserts it follows, which _task dedents together


def _raises(args: str) -> str:
    return _RAISES.format(args=args)


# ------------------------------------------------------------------ strings
_task("is_palindrome", """
    assert candidate('A man, a plan, a canal: Panama') is True
    assert candidate('race a car') is False
    assert candidate('') is True
    assert candidate('No lemon, no melon') is True
    """,
      two_pointers="""
    def is_palindrome(s):
        i, j = 0, len(s) - 1
        while i < j:
            if not s[i].isalnum():
                i += 1
            elif not s[j].isalnum():
                j -= 1
            elif s[i].lower() != s[j].lower():
                return False
            else:
                i += 1
                j -= 1
        return True
    """,
      slicing="""
    def is_palindrome(s):
        cleaned = [c.lower() for c in s if c.isalnum()]
        return cleaned == cleaned[::-1]
    """,
      recursive_regex="""
    import re

    def is_palindrome(s: str) -> bool:
        t = re.sub('[^0-9a-z]', '', s.lower())

        def check(i, j):
            return i >= j or (t[i] == t[j] and check(i + 1, j - 1))

        return check(0, len(t) - 1)
    """,
      fenced_deque=_fenced("""
    from collections import deque

    def is_palindrome(s):
        d = deque(ch.lower() for ch in s if ch.isalnum())
        while len(d) > 1:
            if d.popleft() != d.pop():
                return False
        return True
    """))

_task("reverse_words", """
    assert candidate('hello world') == 'world hello'
    assert candidate('  the sky   is blue ') == 'blue is sky the'
    assert candidate('one') == 'one'
    assert candidate('') == ''
    """,
      char_loop="""
    def reverse_words(s):
        words, cur = [], ''
        for ch in s:
            if ch.isspace():
                if cur:
                    words.append(cur)
                    cur = ''
            else:
                cur += ch
        if cur:
            words.append(cur)
        out = []
        for i in range(len(words) - 1, -1, -1):
            out.append(words[i])
        return ' '.join(out)
    """,
      builtin="""
    def reverse_words(s):
        return ' '.join(reversed(s.split()))
    """,
      recursive="""
    def reverse_words(s):
        def rev(ws):
            if not ws:
                return []
            return rev(ws[1:]) + [ws[0]]
        return ' '.join(rev(s.split()))
    """,
      reduce_future="""
    from __future__ import annotations

    from functools import reduce

    def reverse_words(s: str) -> str:
        words: list[str] = s.split()
        return reduce(lambda acc, w: f'{w} {acc}' if acc else w, words, '')
    """)

_task("count_vowels", """
    assert candidate('Hello World') == 3
    assert candidate('rhythm') == 0
    assert candidate('AEIOUaeiou') == 10
    assert candidate('') == 0
    """,
      frozenset_constant="""
    VOWELS = frozenset('aeiouAEIOU')

    def count_vowels(s):
        n = 0
        for ch in s:
            if ch in VOWELS:
                n += 1
        return n
    """,
      sum_generator="""
    def count_vowels(s):
        return sum(1 for c in s.lower() if c in 'aeiou')
    """,
      regex="""
    import re

    def count_vowels(s: str) -> int:
        '''Number of vowels in s, either case.'''
        return len(re.findall('[aeiou]', s, flags=re.IGNORECASE))
    """,
      fenced_counter=_fenced("""
    from collections import Counter

    def count_vowels(s):
        counts = Counter(s.casefold())
        return sum(counts[v] for v in 'aeiou')
    """))

_task("char_frequency", """
    assert candidate('hello') == {'h': 1, 'e': 1, 'l': 2, 'o': 1}
    assert candidate('a b a') == {'a': 2, 'b': 1}
    assert candidate('') == {}
    """,
      dict_get="""
    def char_frequency(s):
        freq = {}
        for ch in s:
            if ch != ' ':
                freq[ch] = freq.get(ch, 0) + 1
        return freq
    """,
      counter_returned="""
    from collections import Counter

    def char_frequency(s):
        return Counter(s.replace(' ', ''))
    """,
      defaultdict_returned="""
    from collections import defaultdict

    def char_frequency(s):
        freq = defaultdict(int)
        for ch in s:
            if ch != ' ':
                freq[ch] += 1
        return freq
    """,
      dict_comprehension="""
    def char_frequency(s):
        return {c: s.count(c) for c in sorted(set(s)) if c != ' '}
    """)

_task("is_anagram", """
    assert candidate('Listen', 'Silent') is True
    assert candidate('Dormitory', 'dirty room') is True
    assert candidate('abc', 'abd') is False
    assert candidate('a', 'aa') is False
    """,
      sorted_lambda="""
    def is_anagram(a, b):
        norm = lambda s: sorted(s.replace(' ', '').lower())
        return norm(a) == norm(b)
    """,
      counter="""
    from collections import Counter

    def is_anagram(a, b):
        return Counter(a.lower().replace(' ', '')) == Counter(b.lower().replace(' ', ''))
    """,
      count_loop="""
    def is_anagram(a, b):
        counts = {}
        for ch in a.lower():
            if ch != ' ':
                counts[ch] = counts.get(ch, 0) + 1
        for ch in b.lower():
            if ch == ' ':
                continue
            if counts.get(ch, 0) == 0:
                return False
            counts[ch] -= 1
        return not any(counts.values())
    """,
      fenced_filter=_fenced("""
    def is_anagram(a: str, b: str) -> bool:
        '''True when a and b use the same letters (case and spaces ignored).'''
        def key(s: str) -> str:
            return ''.join(sorted(filter(lambda ch: not ch.isspace(), s.casefold())))
        return key(a) == key(b)
    """))

_task("caesar_cipher", """
    assert candidate('abc', 1) == 'bcd'
    assert candidate('Hello, World!', 3) == 'Khoor, Zruog!'
    assert candidate('xyz', 3) == 'abc'
    assert candidate('Khoor', -3) == 'Hello'
    """,
      ord_loop="""
    def caesar_cipher(s, k):
        out = []
        for ch in s:
            if 'a' <= ch <= 'z':
                out.append(chr((ord(ch) - ord('a') + k) % 26 + ord('a')))
            elif 'A' <= ch <= 'Z':
                out.append(chr((ord(ch) - ord('A') + k) % 26 + ord('A')))
            else:
                out.append(ch)
        return ''.join(out)
    """,
      maketrans="""
    import string

    def caesar_cipher(s, k):
        k %= 26
        lo, up = string.ascii_lowercase, string.ascii_uppercase
        table = str.maketrans(lo + up, lo[k:] + lo[:k] + up[k:] + up[:k])
        return s.translate(table)
    """,
      closure="""
    def caesar_cipher(s, k):
        def shift(ch):
            for base in (65, 97):
                if base <= ord(ch) < base + 26:
                    return chr(base + (ord(ch) - base + k) % 26)
            return ch
        return ''.join(shift(ch) for ch in s)
    """,
      callable_class="""
    class Caesar:
        ALPHABET = 'abcdefghijklmnopqrstuvwxyz'

        def __init__(self, key):
            self.key = key % 26

        def __call__(self, ch):
            low = ch.lower()
            if low not in self.ALPHABET:
                return ch
            new = self.ALPHABET[(self.ALPHABET.index(low) + self.key) % 26]
            return new.upper() if ch.isupper() else new

    def caesar_cipher(s, k):
        return ''.join(map(Caesar(k), s))
    """)

_task("run_length_encode", """
    assert candidate('aaabcc') == 'a3b1c2'
    assert candidate('') == ''
    assert candidate('abc') == 'a1b1c1'
    assert candidate('zzzzzzzzzzzz') == 'z12'
    """,
      loop="""
    def run_length_encode(s):
        if not s:
            return ''
        out = []
        prev, count = s[0], 1
        for ch in s[1:]:
            if ch == prev:
                count += 1
            else:
                out.append(f'{prev}{count}')
                prev, count = ch, 1
        out.append(f'{prev}{count}')
        return ''.join(out)
    """,
      groupby="""
    from itertools import groupby

    def run_length_encode(s):
        return ''.join(f'{k}{sum(1 for _ in g)}' for k, g in groupby(s))
    """,
      regex_backreference=r"""
    import re

    def run_length_encode(s):
        return re.sub(r'(.)\1*', lambda m: m.group(1) + str(len(m.group(0))), s, flags=re.S)
    """,
      recursive="""
    def run_length_encode(s):
        if not s:
            return ''
        n = len(s) - len(s.lstrip(s[0]))
        return s[0] + str(n) + run_length_encode(s[n:])
    """)

_task("camel_to_snake", """
    assert candidate('helloWorld') == 'hello_world'
    assert candidate('CamelCaseString') == 'camel_case_string'
    assert candidate('already') == 'already'
    assert candidate('aB') == 'a_b'
    """,
      loop="""
    def camel_to_snake(s):
        out = ''
        for i, ch in enumerate(s):
            if ch.isupper():
                if i:
                    out += '_'
                out += ch.lower()
            else:
                out += ch
        return out
    """,
      comprehension="""
    def camel_to_snake(s):
        return ''.join('_' + c.lower() if c.isupper() and i else c.lower() for i, c in enumerate(s))
    """,
      regex_lookaround="""
    import re

    def camel_to_snake(s):
        return re.sub('(?<!^)(?=[A-Z])', '_', s).lower()
    """,
      generator_future="""
    from __future__ import annotations

    from collections.abc import Iterator

    def _pieces(s: str) -> Iterator[str]:
        for i, ch in enumerate(s):
            if ch.isupper() and i > 0:
                yield '_'
            yield ch.lower()

    def camel_to_snake(s: str) -> str:
        return ''.join(_pieces(s))
    """)

_task("longest_common_prefix", """
    assert candidate(['flower', 'flow', 'flight']) == 'fl'
    assert candidate(['dog', 'racecar', 'car']) == ''
    assert candidate([]) == ''
    assert candidate(['same', 'same']) == 'same'
    """,
      shrink_loop="""
    def longest_common_prefix(words):
        if not words:
            return ''
        prefix = words[0]
        for w in words[1:]:
            while not w.startswith(prefix):
                prefix = prefix[:-1]
        return prefix
    """,
      zip_takewhile="""
    from itertools import takewhile

    def longest_common_prefix(words):
        same = takewhile(lambda chars: len(set(chars)) == 1, zip(*words))
        return ''.join(chars[0] for chars in same)
    """,
      min_max="""
    def longest_common_prefix(words):
        '''Only the alphabetically first and last words need comparing.'''
        if not words:
            return ''
        lo, hi = min(words), max(words)
        i = 0
        while i < len(lo) and lo[i] == hi[i]:
            i += 1
        return lo[:i]
    """,
      fenced_divide_and_conquer=_fenced("""
    def longest_common_prefix(words):
        if not words:
            return ''
        if len(words) == 1:
            return words[0]
        mid = len(words) // 2
        a = longest_common_prefix(words[:mid])
        b = longest_common_prefix(words[mid:])
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        return a[:n]
    """))

_task("extract_numbers", """
    assert candidate('a1b22c-3') == [1, 22, -3]
    assert candidate('no digits') == []
    assert candidate('x=10, y=-20, z=300') == [10, -20, 300]
    """,
      findall=r"""
    import re

    def extract_numbers(text):
        return [int(m) for m in re.findall(r'-?\d+', text)]
    """,
      scanner="""
    def extract_numbers(text):
        out = []
        i, n = 0, len(text)
        while i < n:
            j = i + 1 if text[i] == '-' else i
            k = j
            while k < n and text[k].isdigit():
                k += 1
            if k > j:
                out.append(int(text[i:k]))
                i = k
            else:
                i += 1
        return out
    """,
      finditer_generator=r"""
    import re
    from typing import Iterator

    NUMBER = re.compile(r'-?[0-9]+')

    def _numbers(text: str) -> Iterator[int]:
        for match in NUMBER.finditer(text):
            yield int(match.group())

    def extract_numbers(text: str) -> list[int]:
        return list(_numbers(text))
    """,
      groupby="""
    from itertools import groupby

    def extract_numbers(text):
        out = []
        prev = ''
        for is_digit, grp in groupby(text, key=str.isdigit):
            chunk = ''.join(grp)
            if is_digit:
                out.append(-int(chunk) if prev.endswith('-') else int(chunk))
            prev = chunk
        return out
    """)

_task("most_common_words", """
    assert candidate('the cat and the hat and the bat', 2) == [('the', 3), ('and', 2)]
    assert candidate('', 3) == []
    assert candidate('B a b A c', 2) == [('a', 2), ('b', 2)]
    assert candidate('x y z', 5) == [('x', 1), ('y', 1), ('z', 1)]
    """,
      counter_sorted="""
    from collections import Counter

    def most_common_words(text, n):
        counts = Counter(text.lower().split())
        return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]
    """,
      dict_loop="""
    def most_common_words(text, n):
        counts = {}
        for word in text.lower().split():
            counts[word] = counts.get(word, 0) + 1
        ranked = sorted(counts, key=lambda w: (-counts[w], w))
        return [(w, counts[w]) for w in ranked[:n]]
    """,
      heapq_nsmallest="""
    import heapq
    from collections import defaultdict

    def most_common_words(text, n):
        counts = defaultdict(int)
        for word in map(str.lower, text.split()):
            counts[word] += 1
        return heapq.nsmallest(n, counts.items(), key=lambda kv: (-kv[1], kv[0]))
    """,
      fenced_regex=_fenced(r"""
    import re
    from collections import Counter

    def most_common_words(text: str, n: int) -> list[tuple[str, int]]:
        words = re.findall(r'\w+', text.lower())
        return sorted(Counter(words).items(), key=lambda item: (-item[1], item[0]))[:n]
    """))

_task("parse_key_values", """
    assert candidate('a=1;b=2') == {'a': 1, 'b': 2}
    assert candidate(' x = 10 ; y=-3 ') == {'x': 10, 'y': -3}
    assert candidate('') == {}
    """ + _raises("'a'") + _raises("'a=x'"),
      split_loop="""
    def parse_key_values(s):
        result = {}
        for part in s.split(';'):
            if not part.strip():
                continue
            if '=' not in part:
                raise ValueError(f'bad pair: {part!r}')
            key, value = part.split('=', 1)
            result[key.strip()] = int(value)
        return result
    """,
      comprehension="""
    def parse_key_values(s):
        pairs = (p.split('=') for p in s.split(';') if p.strip())
        return dict((k.strip(), int(v)) for k, v in pairs)
    """,
      regex_fullmatch=r"""
    import re

    PAIR = re.compile(r'\s*(\w+)\s*=\s*(-?\d+)\s*')

    def parse_key_values(s):
        out = {}
        for part in filter(str.strip, s.split(';')):
            m = PAIR.fullmatch(part)
            if m is None:
                raise ValueError(f'cannot parse {part!r}')
            out[m[1]] = int(m[2])
        return out
    """,
      fenced_partition=_fenced("""
    def parse_key_values(text: str) -> dict[str, int]:
        '''Parse "k=v;k2=v2" into a dict of ints.'''
        pairs = {}
        for chunk in text.split(';'):
            if not chunk or chunk.isspace():
                continue
            key, sep, value = chunk.partition('=')
            if not sep:
                raise ValueError(f'missing "=" in {chunk!r}')
            pairs[key.strip()] = int(value.strip())
        return pairs
    """))

_task("balanced_brackets", """
    assert candidate('([]{})') is True
    assert candidate('([)]') is False
    assert candidate('') is True
    assert candidate('((') is False
    assert candidate('a(b)c') is True
    """,
      stack_dict="""
    PAIRS = {')': '(', ']': '[', '}': '{'}

    def balanced_brackets(s):
        stack = []
        for ch in s:
            if ch in '([{':
                stack.append(ch)
            elif ch in PAIRS:
                if not stack or stack.pop() != PAIRS[ch]:
                    return False
        return not stack
    """,
      replace_loop="""
    def balanced_brackets(s):
        t = ''.join(c for c in s if c in '()[]{}')
        while True:
            u = t.replace('()', '').replace('[]', '').replace('{}', '')
            if u == t:
                return t == ''
            t = u
    """,
      recursive_descent="""
    def balanced_brackets(s):
        closing = {'(': ')', '[': ']', '{': '}'}

        def parse(i, want):
            # the index after the bracket `want` that closes this level, or -1
            while i < len(s):
                ch = s[i]
                if ch in closing:
                    i = parse(i + 1, closing[ch])
                    if i < 0:
                        return -1
                elif ch in ')]}':
                    return i + 1 if ch == want else -1
                else:
                    i += 1
            return i if want is None else -1

        return parse(0, None) == len(s)
    """,
      fenced_stack_class=_fenced("""
    class Stack:
        def __init__(self):
            self._items = []

        def push(self, item):
            self._items.append(item)

        def pop(self):
            return self._items.pop() if self._items else None

        def __len__(self):
            return len(self._items)


    def balanced_brackets(s: str) -> bool:
        opening = {')': '(', ']': '[', '}': '{'}
        stack = Stack()
        for ch in s:
            if ch in opening.values():
                stack.push(ch)
            elif ch in opening and stack.pop() != opening[ch]:
                return False
        return len(stack) == 0
    """))

# ------------------------------------------------------------------ numbers
_task("fizzbuzz", """
    assert candidate(5) == ['1', '2', 'Fizz', '4', 'Buzz']
    assert candidate(15)[-1] == 'FizzBuzz'
    assert candidate(0) == []
    assert len(candidate(100)) == 100
    """,
      if_chain="""
    def fizzbuzz(n):
        out = []
        for i in range(1, n + 1):
            if i % 15 == 0:
                out.append('FizzBuzz')
            elif i % 3 == 0:
                out.append('Fizz')
            elif i % 5 == 0:
                out.append('Buzz')
            else:
                out.append(str(i))
        return out
    """,
      comprehension="""
    def fizzbuzz(n):
        return [('Fizz' * (i % 3 == 0) + 'Buzz' * (i % 5 == 0)) or str(i) for i in range(1, n + 1)]
    """,
      infinite_generator="""
    from itertools import count, islice

    def _fizzbuzz():
        for i in count(1):
            yield 'Fizz' * (not i % 3) + 'Buzz' * (not i % 5) or str(i)

    def fizzbuzz(n):
        return list(islice(_fizzbuzz(), n))
    """,
      rules_constant="""
    RULES = ((3, 'Fizz'), (5, 'Buzz'))

    def fizzbuzz(n: int) -> list:
        return [''.join(word for d, word in RULES if i % d == 0) or str(i) for i in range(1, n + 1)]
    """)

_task("fibonacci", """
    assert candidate(0) == 0
    assert candidate(1) == 1
    assert candidate(10) == 55
    assert candidate(90) == 2880067194370816120
    """,
      loop="""
    def fibonacci(n):
        a, b = 0, 1
        for _ in range(n):
            a, b = b, a + b
        return a
    """,
      lru_cache="""
    from functools import lru_cache

    @lru_cache(maxsize=None)
    def fibonacci(n):
        return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)
    """,
      fast_doubling="""
    def fibonacci(n: int) -> int:
        def pair(k):
            if k == 0:
                return (0, 1)
            a, b = pair(k // 2)
            c = a * (2 * b - a)
            d = a * a + b * b
            return (d, c + d) if k % 2 else (c, d)
        return pair(n)[0]
    """,
      fenced_stream=_fenced("""
    from itertools import islice

    def fib_stream():
        a, b = 0, 1
        while True:
            yield a
            a, b = b, a + b

    def fibonacci(n):
        return next(islice(fib_stream(), n, None))
    """))

_task("factorial", """
    assert candidate(0) == 1
    assert candidate(5) == 120
    assert candidate(20) == 2432902008176640000
    """ + _raises("-1"),
      loop="""
    def factorial(n):
        if n < 0:
            raise ValueError('factorial of a negative number')
        result = 1
        for i in range(2, n + 1):
            result *= i
        return result
    """,
      recursive="""
    def factorial(n):
        '''n! for n >= 0.'''
        if n < 0:
            raise ValueError(f'n must be >= 0, got {n}')
        return 1 if n <= 1 else n * factorial(n - 1)
    """,
      math_factorial="""
    import math

    def factorial(n):
        return math.factorial(n)
    """,
      reduce_mul="""
    import operator
    from functools import reduce

    def factorial(n):
        if n < 0:
            raise ValueError('negative')
        return reduce(operator.mul, range(1, n + 1), 1)
    """)

_task("is_prime", """
    assert candidate(2) is True
    assert candidate(1) is False
    assert candidate(97) is True
    assert candidate(91) is False
    assert candidate(7919) is True
    """,
      trial_division="""
    def is_prime(n):
        if n < 2:
            return False
        d = 2
        while d * d <= n:
            if n % d == 0:
                return False
            d += 1
        return True
    """,
      all_isqrt="""
    import math

    def is_prime(n):
        return n > 1 and all(n % d for d in range(2, math.isqrt(n) + 1))
    """,
      six_k="""
    def is_prime(n: int) -> bool:
        if n <= 3:
            return n > 1
        if n % 2 == 0 or n % 3 == 0:
            return False
        i = 5
        while i * i <= n:
            if n % i == 0 or n % (i + 2) == 0:
                return False
            i += 6
        return True
    """,
      fenced_miller_rabin=_fenced("""
    SMALL_PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)

    def is_prime(n):
        if n < 2:
            return False
        for p in SMALL_PRIMES:
            if n % p == 0:
                return n == p
        d, s = n - 1, 0
        while d % 2 == 0:
            d //= 2
            s += 1
        for a in SMALL_PRIMES:
            x = pow(a, d, n)
            if x in (1, n - 1):
                continue
            for _ in range(s - 1):
                x = pow(x, 2, n)
                if x == n - 1:
                    break
            else:
                return False
        return True
    """))

_task("primes_up_to", """
    assert candidate(10) == [2, 3, 5, 7]
    assert candidate(1) == []
    assert candidate(2) == [2]
    assert len(candidate(1000)) == 168
    """,
      sieve="""
    def primes_up_to(n):
        if n < 2:
            return []
        is_p = [True] * (n + 1)
        is_p[0] = is_p[1] = False
        for i in range(2, int(n ** 0.5) + 1):
            if is_p[i]:
                for j in range(i * i, n + 1, i):
                    is_p[j] = False
        return [i for i, p in enumerate(is_p) if p]
    """,
      comprehension="""
    def primes_up_to(n):
        return [p for p in range(2, n + 1) if all(p % d for d in range(2, int(p ** 0.5) + 1))]
    """,
      incremental_generator="""
    from itertools import count, takewhile

    def _primes():
        composites = {}
        for q in count(2):
            if q not in composites:
                yield q
                composites[q * q] = [q]
            else:
                for p in composites.pop(q):
                    composites.setdefault(p + q, []).append(p)

    def primes_up_to(n):
        return list(takewhile(lambda p: p <= n, _primes()))
    """,
      bytearray_compress="""
    from itertools import compress

    def primes_up_to(n: int) -> list[int]:
        if n < 2:
            return []
        sieve = bytearray([1]) * (n + 1)
        sieve[0] = sieve[1] = 0
        for i in range(2, int(n ** 0.5) + 1):
            if sieve[i]:
                sieve[i * i::i] = bytes(len(range(i * i, n + 1, i)))
        return list(compress(range(n + 1), sieve))
    """)

_task("prime_factors", """
    assert candidate(12) == [2, 2, 3]
    assert candidate(97) == [97]
    assert candidate(1) == []
    assert candidate(360) == [2, 2, 2, 3, 3, 5]
    """,
      loop="""
    def prime_factors(n):
        factors = []
        d = 2
        while d * d <= n:
            while n % d == 0:
                factors.append(d)
                n //= d
            d += 1
        if n > 1:
            factors.append(n)
        return factors
    """,
      recursive_default_arg="""
    def prime_factors(n, d=2):
        if n < 2:
            return []
        if d * d > n:
            return [n]
        if n % d == 0:
            return [d] + prime_factors(n // d, d)
        return prime_factors(n, d + 1)
    """,
      generator="""
    def _factor(n):
        p = 2
        while p * p <= n:
            if n % p == 0:
                yield p
                n //= p
            else:
                p += 1
        if n > 1:
            yield n

    def prime_factors(n):
        return list(_factor(n))
    """,
      counter_elements="""
    from collections import Counter

    def prime_factors(n: int) -> list[int]:
        counts: Counter[int] = Counter()
        m, d = n, 2
        while m > 1 and d * d <= m:
            if m % d:
                d += 1
            else:
                counts[d] += 1
                m //= d
        if m > 1:
            counts[m] += 1
        return sorted(counts.elements())
    """)

_task("collatz_steps", """
    assert candidate(1) == 0
    assert candidate(6) == 8
    assert candidate(27) == 111
    """ + _raises("0"),
      while_loop="""
    def collatz_steps(n):
        if n < 1:
            raise ValueError('n must be a positive integer')
        steps = 0
        while n != 1:
            n = n // 2 if n % 2 == 0 else 3 * n + 1
            steps += 1
        return steps
    """,
      functools_cache="""
    from functools import cache

    @cache
    def _steps(n):
        if n == 1:
            return 0
        return 1 + _steps(n // 2 if n % 2 == 0 else 3 * n + 1)

    def collatz_steps(n):
        if n < 1:
            raise ValueError(n)
        return _steps(n)
    """,
      sequence_generator="""
    def _sequence(n):
        yield n
        while n != 1:
            n = n >> 1 if n & 1 == 0 else 3 * n + 1
            yield n

    def collatz_steps(n):
        if n < 1:
            raise ValueError('positive integers only')
        return sum(1 for _ in _sequence(n)) - 1
    """,
      fenced_count=_fenced("""
    from itertools import count

    def collatz_steps(n: int) -> int:
        if n < 1:
            raise ValueError(f'expected n >= 1, got {n}')
        for steps in count():
            if n == 1:
                return steps
            n = n // 2 if n % 2 == 0 else 3 * n + 1
    """))

_task("to_base", """
    assert candidate(10, 2) == '1010'
    assert candidate(255, 16) == 'FF'
    assert candidate(0, 7) == '0'
    assert candidate(-35, 36) == '-Z'
    """ + _raises("5, 1"),
      divmod_loop="""
    DIGITS = '0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ'

    def to_base(n, base):
        if not 2 <= base <= 36:
            raise ValueError('base must be in 2..36')
        if n == 0:
            return '0'
        sign = '-' if n < 0 else ''
        n = abs(n)
        out = []
        while n:
            n, r = divmod(n, base)
            out.append(DIGITS[r])
        return sign + ''.join(reversed(out))
    """,
      recursive_string_module="""
    import string

    DIGITS = string.digits + string.ascii_uppercase

    def to_base(n, base):
        if base < 2 or base > 36:
            raise ValueError(f'unsupported base {base}')
        if n < 0:
            return '-' + to_base(-n, base)
        if n < base:
            return DIGITS[n]
        return to_base(n // base, base) + DIGITS[n % base]
    """,
      digit_generator="""
    def _digits(n, base):
        while True:
            n, r = divmod(n, base)
            yield '0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ'[r]
            if n == 0:
                return

    def to_base(n, base):
        if base not in range(2, 37):
            raise ValueError(base)
        body = ''.join(_digits(abs(n), base))[::-1]
        return '-' + body if n < 0 else body
    """,
      fenced_format_fast_path=_fenced("""
    def to_base(n: int, base: int) -> str:
        if not 2 <= base <= 36:
            raise ValueError('base out of range')
        if base in (2, 8, 16):
            return format(n, {2: 'b', 8: 'o', 16: 'X'}[base])
        digits = []
        m = abs(n)
        while True:
            m, r = divmod(m, base)
            digits.append(chr(ord('0') + r) if r < 10 else chr(ord('A') + r - 10))
            if not m:
                break
        return ('-' if n < 0 else '') + ''.join(reversed(digits))
    """))

_task("roman_to_int", """
    assert candidate('III') == 3
    assert candidate('LVIII') == 58
    assert candidate('MCMXCIV') == 1994
    assert candidate('MMMCMXCIX') == 3999
    """,
      lookahead="""
    VALUES = {'I': 1, 'V': 5, 'X': 10, 'L': 50, 'C': 100, 'D': 500, 'M': 1000}

    def roman_to_int(s):
        total = 0
        for i, ch in enumerate(s):
            v = VALUES[ch]
            if i + 1 < len(s) and VALUES[s[i + 1]] > v:
                total -= v
            else:
                total += v
        return total
    """,
      reversed_prev="""
    def roman_to_int(s):
        values = dict(I=1, V=5, X=10, L=50, C=100, D=500, M=1000)
        total, prev = 0, 0
        for ch in reversed(s):
            v = values[ch]
            if v < prev:
                total -= v
            else:
                total += v
                prev = v
        return total
    """,
      expand_subtractive="""
    def roman_to_int(s):
        for pair, repl in (('CM', 'DCCCC'), ('CD', 'CCCC'), ('XC', 'LXXXX'),
                           ('XL', 'XXXX'), ('IX', 'VIIII'), ('IV', 'IIII')):
            s = s.replace(pair, repl)
        values = dict(zip('IVXLCDM', (1, 5, 10, 50, 100, 500, 1000)))
        return sum(values[c] for c in s)
    """,
      fenced_pairwise=_fenced("""
    from itertools import pairwise

    VALUE = {'I': 1, 'V': 5, 'X': 10, 'L': 50, 'C': 100, 'D': 500, 'M': 1000}

    def roman_to_int(s: str) -> int:
        v = [VALUE[c] for c in s] + [0]
        return sum(a if a >= b else -a for a, b in pairwise(v))
    """))

_task("int_to_roman", """
    assert candidate(3) == 'III'
    assert candidate(58) == 'LVIII'
    assert candidate(1994) == 'MCMXCIV'
    assert candidate(3999) == 'MMMCMXCIX'
    """ + _raises("0") + _raises("4000"),
      greedy_table="""
    TABLE = [(1000, 'M'), (900, 'CM'), (500, 'D'), (400, 'CD'), (100, 'C'), (90, 'XC'),
             (50, 'L'), (40, 'XL'), (10, 'X'), (9, 'IX'), (5, 'V'), (4, 'IV'), (1, 'I')]

    def int_to_roman(n):
        if not 1 <= n <= 3999:
            raise ValueError('out of range')
        out = []
        for value, sym in TABLE:
            while n >= value:
                out.append(sym)
                n -= value
        return ''.join(out)
    """,
      recursive_divmod="""
    TABLE = ((1000, 'M'), (900, 'CM'), (500, 'D'), (400, 'CD'), (100, 'C'), (90, 'XC'),
             (50, 'L'), (40, 'XL'), (10, 'X'), (9, 'IX'), (5, 'V'), (4, 'IV'), (1, 'I'))

    def int_to_roman(n):
        if not 0 < n < 4000:
            raise ValueError(n)

        def go(n, i):
            if n == 0:
                return ''
            value, sym = TABLE[i]
            q, r = divmod(n, value)
            return sym * q + go(r, i + 1)

        return go(n, 0)
    """,
      digit_tables="""
    THOUSANDS = ['', 'M', 'MM', 'MMM']
    HUNDREDS = ['', 'C', 'CC', 'CCC', 'CD', 'D', 'DC', 'DCC', 'DCCC', 'CM']
    TENS = ['', 'X', 'XX', 'XXX', 'XL', 'L', 'LX', 'LXX', 'LXXX', 'XC']
    ONES = ['', 'I', 'II', 'III', 'IV', 'V', 'VI', 'VII', 'VIII', 'IX']

    def int_to_roman(n: int) -> str:
        if n < 1 or n > 3999:
            raise ValueError(f'{n} has no Roman numeral')
        return THOUSANDS[n // 1000] + HUNDREDS[n // 100 % 10] + TENS[n // 10 % 10] + ONES[n % 10]
    """,
      int_enum="""
    from enum import IntEnum

    class Numeral(IntEnum):
        M = 1000
        CM = 900
        D = 500
        CD = 400
        C = 100
        XC = 90
        L = 50
        XL = 40
        X = 10
        IX = 9
        V = 5
        IV = 4
        I = 1

    def int_to_roman(n):
        if not isinstance(n, int) or not 1 <= n <= 3999:
            raise ValueError('expected an int in 1..3999')
        out = []
        for numeral in Numeral:
            count, n = divmod(n, numeral)
            out.append(numeral.name * count)
        return ''.join(out)
    """)

_task("harmonic", """
    from fractions import Fraction
    assert candidate(1) == 1
    assert candidate(3) == Fraction(11, 6)
    assert candidate(10) == Fraction(7381, 2520)
    assert candidate(0) == 0
    """,
      loop="""
    from fractions import Fraction

    def harmonic(n):
        total = Fraction(0)
        for k in range(1, n + 1):
            total += Fraction(1, k)
        return total
    """,
      sum_generator="""
    from fractions import Fraction

    def harmonic(n):
        return sum((Fraction(1, k) for k in range(1, n + 1)), Fraction(0))
    """,
      reduce_map="""
    import operator
    from fractions import Fraction
    from functools import reduce
    from itertools import repeat

    def harmonic(n):
        return reduce(operator.add, map(Fraction, repeat(1), range(1, n + 1)), Fraction(0))
    """,
      lru_cache_recursive="""
    from __future__ import annotations

    from fractions import Fraction
    from functools import lru_cache

    @lru_cache(maxsize=128)
    def harmonic(n: int) -> Fraction:
        return Fraction(0) if n == 0 else harmonic(n - 1) + Fraction(1, n)
    """)

_task("determinant", """
    assert candidate([[1, 2], [3, 4]]) == -2
    assert candidate([[2]]) == 2
    assert candidate([[6, 1, 1], [4, -2, 5], [2, 8, 7]]) == -306
    assert candidate([[1, 2], [2, 4]]) == 0
    """,
      cofactor_recursion="""
    def determinant(m):
        if len(m) == 1:
            return m[0][0]
        total = 0
        for j, value in enumerate(m[0]):
            minor = [row[:j] + row[j + 1:] for row in m[1:]]
            total += (-1) ** j * value * determinant(minor)
        return total
    """,
      gaussian_fraction="""
    from fractions import Fraction

    def determinant(m):
        a = [[Fraction(x) for x in row] for row in m]
        n, det = len(a), Fraction(1)
        for col in range(n):
            pivot = next((r for r in range(col, n) if a[r][col] != 0), None)
            if pivot is None:
                return Fraction(0)
            if pivot != col:
                a[col], a[pivot] = a[pivot], a[col]
                det = -det
            det *= a[col][col]
            for r in range(col + 1, n):
                factor = a[r][col] / a[col][col]
                for c in range(col, n):
                    a[r][c] -= factor * a[col][c]
        return det
    """,
      leibniz_permutations="""
    import math
    from itertools import permutations

    def _sign(p):
        inversions = sum(1 for i in range(len(p)) for j in range(i + 1, len(p)) if p[i] > p[j])
        return -1 if inversions % 2 else 1

    def determinant(m):
        n = len(m)
        return sum(_sign(p) * math.prod(m[i][p[i]] for i in range(n)) for p in permutations(range(n)))
    """,
      fenced_cached_tuples=_fenced("""
    from __future__ import annotations

    from functools import lru_cache

    Matrix = tuple[tuple[int, ...], ...]

    @lru_cache(maxsize=None)
    def _det(m: Matrix) -> int:
        if len(m) == 1:
            return m[0][0]
        return sum((-1) ** j * m[0][j] * _det(tuple(r[:j] + r[j + 1:] for r in m[1:])) for j in range(len(m)))

    def determinant(m: list[list[int]]) -> int:
        return _det(tuple(map(tuple, m)))
    """))

_task("median", """
    assert candidate([3, 1, 2]) == 2
    assert candidate([4, 1, 3, 2]) == 2.5
    assert candidate([5]) == 5
    assert candidate([1, 2, 3, 4, 5, 6]) == 3.5
    """ + _raises("[]"),
      sorted_index="""
    def median(xs):
        if not xs:
            raise ValueError('median of an empty list')
        s = sorted(xs)
        mid = len(s) // 2
        return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2
    """,
      statistics="""
    import statistics

    def median(xs):
        return statistics.median(xs)
    """,
      quickselect="""
    def _select(xs, k):
        pivot = xs[len(xs) // 2]
        lows = [x for x in xs if x < pivot]
        highs = [x for x in xs if x > pivot]
        pivots = len(xs) - len(lows) - len(highs)
        if k < len(lows):
            return _select(lows, k)
        if k < len(lows) + pivots:
            return pivot
        return _select(highs, k - len(lows) - pivots)

    def median(xs):
        if not xs:
            raise ValueError('no median for empty data')
        n = len(xs)
        if n % 2:
            return _select(xs, n // 2)
        return (_select(xs, n // 2 - 1) + _select(xs, n // 2)) / 2
    """,
      fenced_heapq=_fenced("""
    import heapq

    def median(xs):
        if len(xs) == 0:
            raise ValueError('empty input')
        half = heapq.nsmallest(len(xs) // 2 + 1, xs)
        if len(xs) % 2:
            return half[-1]
        return (half[-1] + half[-2]) / 2
    """))

_task("variance", """
    import math
    assert math.isclose(candidate([1, 2, 3, 4]), 1.25)
    assert candidate([5, 5, 5]) == 0
    assert math.isclose(candidate([2, 4, 4, 4, 5, 5, 7, 9]), 4.0)
    """,
      two_pass="""
    def variance(xs):
        mean = sum(xs) / len(xs)
        total = 0.0
        for x in xs:
            total += (x - mean) ** 2
        return total / len(xs)
    """,
      statistics="""
    from statistics import pvariance

    def variance(xs):
        return pvariance(xs)
    """,
      welford_dataclass="""
    from dataclasses import dataclass

    @dataclass
    class Running:
        n: int = 0
        mean: float = 0.0
        m2: float = 0.0

        def push(self, x):
            self.n += 1
            delta = x - self.mean
            self.mean += delta / self.n
            self.m2 += delta * (x - self.mean)

    def variance(xs):
        r = Running()
        for x in xs:
            r.push(x)
        return r.m2 / r.n
    """,
      decimal_exact="""
    from decimal import Decimal, localcontext

    def variance(xs):
        with localcontext() as ctx:
            ctx.prec = 50
            values = [Decimal(x) for x in xs]
            mean = sum(values) / len(values)
            return float(sum((v - mean) ** 2 for v in values) / len(values))
    """)

_task("moving_average", """
    assert candidate([1, 2, 3, 4], 2) == [1.5, 2.5, 3.5]
    assert candidate([5], 1) == [5.0]
    assert candidate([1, 2], 3) == []
    assert candidate([2, 4, 6, 8], 4) == [5.0]
    """,
      sliding_sum="""
    def moving_average(xs, k):
        if k > len(xs):
            return []
        window = sum(xs[:k])
        out = [window / k]
        for i in range(k, len(xs)):
            window += xs[i] - xs[i - k]
            out.append(window / k)
        return out
    """,
      comprehension="""
    def moving_average(xs, k):
        return [sum(xs[i:i + k]) / k for i in range(len(xs) - k + 1)]
    """,
      deque_generator="""
    from collections import deque

    def _windows(xs, k):
        win = deque(maxlen=k)
        for x in xs:
            win.append(x)
            if len(win) == k:
                yield sum(win) / k

    def moving_average(xs, k):
        return list(_windows(xs, k))
    """,
      accumulate_future="""
    from __future__ import annotations

    from itertools import accumulate

    def moving_average(xs: list[float], k: int) -> list[float]:
        pre = [0, *accumulate(xs)]
        return [(pre[i + k] - pre[i]) / k for i in range(len(xs) - k + 1)]
    """)

# ------------------------------------------------------------------ lists and searching
_task("binary_search", """
    assert candidate([1, 3, 5, 7, 9], 7) == 3
    assert candidate([1, 3, 5, 7, 9], 4) == -1
    assert candidate([], 1) == -1
    assert candidate([2], 2) == 0
    """,
      iterative="""
    def binary_search(xs, target):
        lo, hi = 0, len(xs) - 1
        while lo <= hi:
            mid = (lo + hi) // 2
            if xs[mid] == target:
                return mid
            if xs[mid] < target:
                lo = mid + 1
            else:
                hi = mid - 1
        return -1
    """,
      recursive="""
    def binary_search(xs, target, lo=0, hi=None):
        if hi is None:
            hi = len(xs)
        if lo >= hi:
            return -1
        mid = (lo + hi) // 2
        if xs[mid] == target:
            return mid
        if xs[mid] < target:
            return binary_search(xs, target, mid + 1, hi)
        return binary_search(xs, target, lo, mid)
    """,
      bisect="""
    from bisect import bisect_left

    def binary_search(xs, target):
        i = bisect_left(xs, target)
        return i if i < len(xs) and xs[i] == target else -1
    """,
      fenced_typevar=_fenced("""
    from typing import Sequence, TypeVar

    T = TypeVar('T')

    def binary_search(xs: Sequence[T], target: T) -> int:
        lo, hi = 0, len(xs)
        while lo < hi:
            mid = (lo + hi) // 2
            if xs[mid] < target:  # type: ignore[operator]
                lo = mid + 1
            else:
                hi = mid
        return lo if lo < len(xs) and xs[lo] == target else -1
    """))

_task("merge_sorted", """
    assert candidate([1, 4, 7], [2, 3, 8]) == [1, 2, 3, 4, 7, 8]
    assert candidate([], [1]) == [1]
    assert candidate([1, 1], [1]) == [1, 1, 1]
    assert candidate([], []) == []
    """,
      two_pointers="""
    def merge_sorted(a, b):
        i = j = 0
        out = []
        while i < len(a) and j < len(b):
            if a[i] <= b[j]:
                out.append(a[i])
                i += 1
            else:
                out.append(b[j])
                j += 1
        out.extend(a[i:])
        out.extend(b[j:])
        return out
    """,
      heapq_merge="""
    import heapq

    def merge_sorted(a, b):
        return list(heapq.merge(a, b))
    """,
      recursive="""
    def merge_sorted(a, b):
        if not a:
            return list(b)
        if not b:
            return list(a)
        if a[0] <= b[0]:
            return [a[0]] + merge_sorted(a[1:], b)
        return [b[0]] + merge_sorted(a, b[1:])
    """,
      sentinel_generator="""
    _END = object()

    def _merge(a, b):
        ia, ib = iter(a), iter(b)
        x, y = next(ia, _END), next(ib, _END)
        while x is not _END and y is not _END:
            if x <= y:
                yield x
                x = next(ia, _END)
            else:
                yield y
                y = next(ib, _END)
        if x is not _END:
            yield x
            yield from ia
        if y is not _END:
            yield y
            yield from ib

    def merge_sorted(a, b):
        return list(_merge(a, b))
    """)

_task("flatten", """
    assert candidate([1, [2, [3, [4]], 5]]) == [1, 2, 3, 4, 5]
    assert candidate([]) == []
    assert candidate([[[]]]) == []
    assert candidate([1, (2, 3)]) == [1, (2, 3)]
    """,
      recursive="""
    def flatten(nested):
        out = []
        for item in nested:
            if isinstance(item, list):
                out.extend(flatten(item))
            else:
                out.append(item)
        return out
    """,
      yield_from="""
    def _walk(items):
        for item in items:
            if isinstance(item, list):
                yield from _walk(item)
            else:
                yield item

    def flatten(nested):
        return list(_walk(nested))
    """,
      explicit_stack="""
    def flatten(nested):
        out, stack = [], [iter(nested)]
        while stack:
            for item in stack[-1]:
                if isinstance(item, list):
                    stack.append(iter(item))
                    break
                out.append(item)
            else:
                stack.pop()
        return out
    """,
      fenced_reduce=_fenced("""
    from functools import reduce

    def flatten(nested):
        return reduce(lambda acc, x: acc + (flatten(x) if isinstance(x, list) else [x]), nested, [])
    """))

_task("chunk", """
    assert candidate([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]
    assert candidate([], 3) == []
    assert candidate([1, 2], 5) == [[1, 2]]
    """ + _raises("[1, 2], 0"),
      slicing="""
    def chunk(xs, size):
        if size < 1:
            raise ValueError('size must be >= 1')
        return [xs[i:i + size] for i in range(0, len(xs), size)]
    """,
      append_loop="""
    def chunk(xs, size):
        if size <= 0:
            raise ValueError(size)
        out, cur = [], []
        for x in xs:
            cur.append(x)
            if len(cur) == size:
                out.append(cur)
                cur = []
        if cur:
            out.append(cur)
        return out
    """,
      islice_sentinel="""
    from itertools import islice

    def chunk(xs, size):
        if size < 1:
            raise ValueError('size must be positive')
        it = iter(xs)
        return list(iter(lambda: list(islice(it, size)), []))
    """,
      fenced_generator=_fenced("""
    from typing import Iterable, Iterator, List, TypeVar

    T = TypeVar('T')

    def chunks(xs: Iterable[T], size: int) -> Iterator[List[T]]:
        buf: List[T] = []
        for x in xs:
            buf.append(x)
            if len(buf) == size:
                yield buf
                buf = []
        if buf:
            yield buf

    def chunk(xs: List[T], size: int) -> List[List[T]]:
        if size < 1:
            raise ValueError(f'chunk size must be positive, got {size}')
        return list(chunks(xs, size))
    """))

_task("unique_in_order", """
    assert candidate([3, 1, 3, 2, 1]) == [3, 1, 2]
    assert candidate([]) == []
    assert candidate(['a', 'A', 'a']) == ['a', 'A']
    """,
      seen_set="""
    def unique_in_order(xs):
        seen = set()
        out = []
        for x in xs:
            if x not in seen:
                seen.add(x)
                out.append(x)
        return out
    """,
      dict_fromkeys="""
    def unique_in_order(xs):
        return list(dict.fromkeys(xs))
    """,
      comprehension_side_effect="""
    def unique_in_order(xs):
        seen = set()
        return [x for x in xs if not (x in seen or seen.add(x))]
    """,
      fenced_typed_generator=_fenced("""
    from typing import Hashable, Iterable, Iterator

    def _first_seen(items: Iterable[Hashable]) -> Iterator[Hashable]:
        seen: set = set()
        for item in items:
            if item in seen:
                continue
            seen.add(item)
            yield item

    def unique_in_order(xs):
        return list(_first_seen(xs))
    """))

_task("second_largest", """
    assert candidate([3, 1, 4, 1, 5]) == 4
    assert candidate([10, 10, 9]) == 9
    assert candidate([-1, -2]) == -2
    """ + _raises("[5, 5]"),
      one_pass="""
    def second_largest(xs):
        first = second = None
        for x in xs:
            if first is None or x > first:
                first, second = x, first
            elif x != first and (second is None or x > second):
                second = x
        if second is None:
            raise ValueError('need two distinct values')
        return second
    """,
      sorted_set="""
    def second_largest(xs):
        vals = sorted(set(xs))
        if len(vals) < 2:
            raise ValueError('fewer than two distinct values')
        return vals[-2]
    """,
      heapq_nlargest="""
    import heapq

    def second_largest(xs):
        top = heapq.nlargest(2, set(xs))
        if len(top) < 2:
            raise ValueError(xs)
        return top[1]
    """,
      fenced_index_error=_fenced("""
    def second_largest(xs):
        try:
            return sorted(set(xs), reverse=True)[1]
        except IndexError:
            raise ValueError('fewer than two distinct values') from None
    """))

_task("two_sum", """
    assert candidate([2, 7, 11, 15], 9) == (0, 1)
    assert candidate([3, 2, 4], 6) == (1, 2)
    assert candidate([1, 2], 7) is None
    """,
      dict_one_pass="""
    def two_sum(nums, target):
        seen = {}
        for i, x in enumerate(nums):
            if target - x in seen:
                return (seen[target - x], i)
            seen[x] = i
        return None
    """,
      double_loop="""
    def two_sum(nums, target):
        for i in range(len(nums)):
            for j in range(i + 1, len(nums)):
                if nums[i] + nums[j] == target:
                    return i, j
    """,
      sorted_two_pointers="""
    def two_sum(nums, target):
        order = sorted(range(len(nums)), key=nums.__getitem__)
        lo, hi = 0, len(order) - 1
        while lo < hi:
            s = nums[order[lo]] + nums[order[hi]]
            if s == target:
                return tuple(sorted((order[lo], order[hi])))
            if s < target:
                lo += 1
            else:
                hi -= 1
        return None
    """,
      combinations="""
    from itertools import combinations

    def two_sum(nums, target):
        pairs = combinations(enumerate(nums), 2)
        return next(((i, j) for (i, a), (j, b) in pairs if a + b == target), None)
    """)

_task("power_set", """
    assert candidate([1, 2, 3]) == [(), (1,), (2,), (3,), (1, 2), (1, 3), (2, 3), (1, 2, 3)]
    assert candidate([]) == [()]
    assert len(candidate(list(range(10)))) == 1024
    """,
      itertools_chain="""
    from itertools import chain, combinations

    def power_set(xs):
        return list(chain.from_iterable(combinations(xs, r) for r in range(len(xs) + 1)))
    """,
      bitmask="""
    def power_set(xs):
        n = len(xs)
        subsets = []
        for mask in range(1 << n):
            subsets.append(tuple(i for i in range(n) if mask >> i & 1))
        subsets.sort(key=lambda idx: (len(idx), idx))
        return [tuple(xs[i] for i in idx) for idx in subsets]
    """,
      recursive_by_size="""
    def power_set(xs):
        def combos(start, r):
            if r == 0:
                return [()]
            return [(xs[i],) + rest for i in range(start, len(xs)) for rest in combos(i + 1, r - 1)]
        return [c for r in range(len(xs) + 1) for c in combos(0, r)]
    """,
      fenced_generator=_fenced("""
    from itertools import combinations

    def subsets(xs):
        for size in range(len(xs) + 1):
            yield from combinations(xs, size)

    def power_set(xs):
        return list(subsets(xs))
    """))

_task("unique_permutations", """
    assert candidate('abc') == ['abc', 'acb', 'bac', 'bca', 'cab', 'cba']
    assert candidate('aab') == ['aab', 'aba', 'baa']
    assert candidate('') == ['']
    """,
      itertools_set="""
    from itertools import permutations

    def unique_permutations(s):
        return sorted({''.join(p) for p in permutations(s)})
    """,
      backtracking_counter="""
    from collections import Counter

    def unique_permutations(s):
        counts = Counter(s)
        out = []

        def build(prefix):
            if len(prefix) == len(s):
                out.append(prefix)
                return
            for ch in sorted(counts):
                if counts[ch]:
                    counts[ch] -= 1
                    build(prefix + ch)
                    counts[ch] += 1

        build('')
        return out
    """,
      recursive_set="""
    def unique_permutations(s):
        if len(s) <= 1:
            return [s]
        result = set()
        for i, ch in enumerate(s):
            for rest in unique_permutations(s[:i] + s[i + 1:]):
                result.add(ch + rest)
        return sorted(result)
    """,
      fenced_next_permutation=_fenced("""
    def unique_permutations(s):
        chars = sorted(s)
        out = [''.join(chars)]
        while True:
            i = len(chars) - 2
            while i >= 0 and chars[i] >= chars[i + 1]:
                i -= 1
            if i < 0:
                return out
            j = len(chars) - 1
            while chars[j] <= chars[i]:
                j -= 1
            chars[i], chars[j] = chars[j], chars[i]
            chars[i + 1:] = reversed(chars[i + 1:])
            out.append(''.join(chars))
    """))

_task("merge_intervals", """
    assert candidate([[1, 3], [2, 6], [8, 10], [15, 18]]) == [[1, 6], [8, 10], [15, 18]]
    assert candidate([[1, 4], [4, 5]]) == [[1, 5]]
    assert candidate([]) == []
    assert candidate([[5, 6], [1, 2]]) == [[1, 2], [5, 6]]
    """,
      sort_loop="""
    def merge_intervals(intervals):
        merged = []
        for start, end in sorted(intervals):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        return merged
    """,
      reduce="""
    from functools import reduce

    def merge_intervals(intervals):
        def step(acc, iv):
            if acc and iv[0] <= acc[-1][1]:
                return acc[:-1] + [[acc[-1][0], max(acc[-1][1], iv[1])]]
            return acc + [list(iv)]
        return reduce(step, sorted(intervals), [])
    """,
      named_tuple="""
    from typing import NamedTuple

    class Interval(NamedTuple):
        start: int
        end: int

    def merge_intervals(intervals):
        merged: list[Interval] = []
        for iv in sorted(Interval(*p) for p in intervals):
            if merged and iv.start <= merged[-1].end:
                merged[-1] = merged[-1]._replace(end=max(merged[-1].end, iv.end))
            else:
                merged.append(iv)
        return [list(iv) for iv in merged]
    """,
      fenced_generator=_fenced("""
    def _merged(intervals):
        it = iter(sorted(intervals))
        try:
            start, end = next(it)
        except StopIteration:
            return
        for s, e in it:
            if s <= end:
                end = max(end, e)
            else:
                yield [start, end]
                start, end = s, e
        yield [start, end]

    def merge_intervals(intervals):
        return list(_merged(intervals))
    """))

_task("common_elements", """
    assert candidate([1, 2, 3], [2, 3, 4], [3, 2]) == {2, 3}
    assert candidate([1, 2], [3]) == set()
    assert candidate(['a', 'b', 'a']) == {'a', 'b'}
    """,
      set_intersection="""
    def common_elements(first, *rest):
        return set(first).intersection(*rest)
    """,
      reduce_and="""
    import operator
    from functools import reduce

    def common_elements(*lists):
        return reduce(operator.and_, map(set, lists))
    """,
      loop="""
    def common_elements(*lists):
        result = set(lists[0])
        for other in lists[1:]:
            keep = set()
            for x in other:
                if x in result:
                    keep.add(x)
            result = keep
        return result
    """,
      frozenset_comprehension="""
    def common_elements(*lists):
        others = [frozenset(xs) for xs in lists[1:]]
        return {x for x in lists[0] if all(x in o for o in others)}
    """)

_task("running_total", """
    assert list(candidate([1, 2, 3])) == [1, 3, 6]
    assert list(candidate([])) == []
    assert list(candidate([5, -5, 5])) == [5, 0, 5]
    """,
      generator="""
    def running_total(xs):
        total = 0
        for x in xs:
            total += x
            yield total
    """,
      accumulate="""
    from itertools import accumulate

    def running_total(xs):
        return accumulate(xs)
    """,
      closure_map="""
    def running_total(xs):
        total = 0

        def add(x):
            nonlocal total
            total += x
            return total

        return map(add, xs)
    """,
      list_result="""
    def running_total(xs):
        out = []
        for x in xs:
            out.append(x + (out[-1] if out else 0))
        return out
    """)

# ------------------------------------------------------------------ dicts
_task("group_by_length", """
    assert candidate(['a', 'bb', 'c', 'ddd']) == {1: ['a', 'c'], 2: ['bb'], 3: ['ddd']}
    assert candidate([]) == {}
    assert candidate(['xy', 'zw']) == {2: ['xy', 'zw']}
    """,
      defaultdict="""
    from collections import defaultdict

    def group_by_length(words):
        groups = defaultdict(list)
        for w in words:
            groups[len(w)].append(w)
        return dict(groups)
    """,
      setdefault="""
    def group_by_length(words):
        groups = {}
        for w in words:
            groups.setdefault(len(w), []).append(w)
        return groups
    """,
      groupby_sorted="""
    from itertools import groupby

    def group_by_length(words):
        return {k: list(g) for k, g in groupby(sorted(words, key=len), key=len)}
    """,
      nested_comprehension="""
    def group_by_length(words):
        return {n: [w for w in words if len(w) == n] for n in {len(w) for w in words}}
    """)

_task("merge_counts", """
    a = {'x': 1, 'y': 2}
    assert candidate(a, {'y': 3, 'z': 4}) == {'x': 1, 'y': 5, 'z': 4}
    assert a == {'x': 1, 'y': 2}
    assert candidate({}, {'a': 1}) == {'a': 1}
    assert candidate({'a': 0}, {}) == {'a': 0}
    """,
      copy_loop="""
    def merge_counts(a, b):
        out = dict(a)
        for k, v in b.items():
            out[k] = out.get(k, 0) + v
        return out
    """,
      key_union="""
    def merge_counts(a, b):
        return {k: a.get(k, 0) + b.get(k, 0) for k in a.keys() | b.keys()}
    """,
      counter_update="""
    from collections import Counter

    def merge_counts(a, b):
        c = Counter(a)
        c.update(b)
        return dict(c)
    """,
      fenced_reduce=_fenced("""
    from functools import reduce

    def merge_counts(a, b):
        return reduce(lambda acc, kv: {**acc, kv[0]: acc.get(kv[0], 0) + kv[1]}, b.items(), dict(a))
    """))

_task("flatten_dict", """
    assert candidate({'a': 1, 'b': {'c': 2, 'd': {'e': 3}}}) == {'a': 1, 'b.c': 2, 'b.d.e': 3}
    assert candidate({}) == {}
    assert candidate({'x': {'y': 1}}, sep='/') == {'x/y': 1}
    """,
      recursive="""
    def flatten_dict(d, sep='.', parent=''):
        out = {}
        for k, v in d.items():
            key = f'{parent}{sep}{k}' if parent else k
            if isinstance(v, dict):
                out.update(flatten_dict(v, sep, key))
            else:
                out[key] = v
        return out
    """,
      generator="""
    def _items(d, sep, prefix):
        for k, v in d.items():
            path = prefix + (k,)
            if isinstance(v, dict):
                yield from _items(v, sep, path)
            else:
                yield sep.join(path), v

    def flatten_dict(d, sep='.'):
        return dict(_items(d, sep, ()))
    """,
      explicit_stack="""
    def flatten_dict(d, sep='.'):
        out = {}
        stack = [('', d)]
        while stack:
            prefix, node = stack.pop()
            for k, v in node.items():
                key = prefix + sep + k if prefix else k
                if isinstance(v, dict):
                    stack.append((key, v))
                else:
                    out[key] = v
        return out
    """,
      fenced_closure=_fenced("""
    from typing import Any, Dict

    def flatten_dict(d: Dict[str, Any], sep: str = '.') -> Dict[str, Any]:
        result: Dict[str, Any] = {}

        def visit(node: Dict[str, Any], path: str) -> None:
            for key, value in node.items():
                full = f'{path}{sep}{key}' if path else key
                if isinstance(value, dict):
                    visit(value, full)
                else:
                    result[full] = value

        visit(d, '')
        return result
    """))

# ------------------------------------------------------------------ matrices and grids
_task("transpose", """
    assert candidate([[1, 2, 3], [4, 5, 6]]) == [[1, 4], [2, 5], [3, 6]]
    assert candidate([[1]]) == [[1]]
    assert candidate([]) == []
    """,
      zip_star="""
    def transpose(matrix):
        return [list(row) for row in zip(*matrix)]
    """,
      nested_loops="""
    def transpose(matrix):
        if not matrix:
            return []
        out = []
        for j in range(len(matrix[0])):
            row = []
            for i in range(len(matrix)):
                row.append(matrix[i][j])
            out.append(row)
        return out
    """,
      index_comprehension="""
    def transpose(matrix):
        return [[row[j] for row in matrix] for j in range(len(matrix[0]))] if matrix else []
    """,
      optional_numpy="""
    try:
        import numpy as np
    except ImportError:
        np = None

    def transpose(matrix):
        if not matrix:
            return []
        if np is not None:
            return np.array(matrix).T.tolist()
        return [list(col) for col in zip(*matrix)]
    """)

_task("matrix_multiply", """
    assert candidate([[1, 2], [3, 4]], [[5, 6], [7, 8]]) == [[19, 22], [43, 50]]
    assert candidate([[1, 0], [0, 1]], [[9, 8], [7, 6]]) == [[9, 8], [7, 6]]
    assert candidate([[2, 3]], [[4], [5]]) == [[23]]
    """ + _raises("[[1, 2]], [[1, 2]]"),
      triple_loop="""
    def matrix_multiply(a, b):
        if len(a[0]) != len(b):
            raise ValueError('inner dimensions differ')
        rows, inner, cols = len(a), len(b), len(b[0])
        out = [[0] * cols for _ in range(rows)]
        for i in range(rows):
            for j in range(cols):
                for k in range(inner):
                    out[i][j] += a[i][k] * b[k][j]
        return out
    """,
      zip_columns="""
    def matrix_multiply(a, b):
        if not a or len(a[0]) != len(b):
            raise ValueError('shape mismatch')
        cols = list(zip(*b))
        return [[sum(x * y for x, y in zip(row, col)) for col in cols] for row in a]
    """,
      dataclass_matmul="""
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Matrix:
        rows: tuple

        @property
        def shape(self):
            return len(self.rows), len(self.rows[0])

        def __matmul__(self, other):
            if self.shape[1] != other.shape[0]:
                raise ValueError(f'cannot multiply {self.shape} by {other.shape}')
            cols = tuple(zip(*other.rows))
            return Matrix(tuple(tuple(sum(map(lambda p: p[0] * p[1], zip(r, c))) for c in cols)
                                for r in self.rows))

    def matrix_multiply(a, b):
        product = Matrix(tuple(map(tuple, a))) @ Matrix(tuple(map(tuple, b)))
        return [list(r) for r in product.rows]
    """,
      optional_numpy_operator="""
    import operator

    try:
        import numpy as np
    except ImportError:
        np = None

    def matrix_multiply(a, b):
        if len(a[0]) != len(b):
            raise ValueError('incompatible shapes')
        if np is not None:
            return (np.array(a, dtype=object) @ np.array(b, dtype=object)).tolist()
        return [[sum(map(operator.mul, row, col)) for col in zip(*b)] for row in a]
    """)

_task("spiral_order", """
    assert candidate([[1, 2, 3], [4, 5, 6], [7, 8, 9]]) == [1, 2, 3, 6, 9, 8, 7, 4, 5]
    assert candidate([[1, 2], [3, 4], [5, 6]]) == [1, 2, 4, 6, 5, 3]
    assert candidate([]) == []
    assert candidate([[7]]) == [7]
    """,
      boundaries="""
    def spiral_order(matrix):
        out = []
        if not matrix:
            return out
        top, bottom, left, right = 0, len(matrix) - 1, 0, len(matrix[0]) - 1
        while top <= bottom and left <= right:
            for j in range(left, right + 1):
                out.append(matrix[top][j])
            for i in range(top + 1, bottom + 1):
                out.append(matrix[i][right])
            if top < bottom and left < right:
                for j in range(right - 1, left - 1, -1):
                    out.append(matrix[bottom][j])
                for i in range(bottom - 1, top, -1):
                    out.append(matrix[i][left])
            top, bottom, left, right = top + 1, bottom - 1, left + 1, right - 1
        return out
    """,
      recursive_rotate="""
    def spiral_order(matrix):
        if not matrix:
            return []
        rest = [list(r) for r in zip(*matrix[1:])][::-1]
        return list(matrix[0]) + spiral_order(rest)
    """,
      direction_vectors="""
    DIRECTIONS = ((0, 1), (1, 0), (0, -1), (-1, 0))

    def spiral_order(matrix):
        if not matrix:
            return []
        rows, cols = len(matrix), len(matrix[0])
        seen = set()
        r = c = d = 0
        out = []
        for _ in range(rows * cols):
            out.append(matrix[r][c])
            seen.add((r, c))
            nr, nc = r + DIRECTIONS[d][0], c + DIRECTIONS[d][1]
            if not (0 <= nr < rows and 0 <= nc < cols) or (nr, nc) in seen:
                d = (d + 1) % 4
                nr, nc = r + DIRECTIONS[d][0], c + DIRECTIONS[d][1]
            r, c = nr, nc
        return out
    """,
      fenced_peel_generator=_fenced("""
    def _spiral(rows):
        rows = [list(r) for r in rows]
        while rows:
            yield from rows.pop(0)
            rows = [list(r) for r in zip(*rows)][::-1]

    def spiral_order(matrix):
        return list(_spiral(matrix))
    """))

_task("count_islands", """
    assert candidate(['11000', '11000', '00100', '00011']) == 3
    assert candidate([]) == 0
    assert candidate(['111', '010', '111']) == 1
    assert candidate(['101', '010', '101']) == 5
    """,
      recursive_dfs="""
    def count_islands(grid):
        seen = set()

        def sink(r, c):
            if not (0 <= r < len(grid) and 0 <= c < len(grid[0])):
                return
            if grid[r][c] != '1' or (r, c) in seen:
                return
            seen.add((r, c))
            for dr, dc in ((1, 0), (-1, 0), (0, 1), (0, -1)):
                sink(r + dr, c + dc)

        islands = 0
        for r in range(len(grid)):
            for c in range(len(grid[0])):
                if grid[r][c] == '1' and (r, c) not in seen:
                    islands += 1
                    sink(r, c)
        return islands
    """,
      bfs_deque="""
    from collections import deque

    def count_islands(grid):
        land = {(r, c) for r, row in enumerate(grid) for c, ch in enumerate(row) if ch == '1'}
        islands = 0
        while land:
            islands += 1
            queue = deque([land.pop()])
            while queue:
                r, c = queue.popleft()
                for nb in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
                    if nb in land:
                        land.remove(nb)
                        queue.append(nb)
        return islands
    """,
      union_find_class="""
    class DisjointSet:
        def __init__(self):
            self.parent = {}

        def add(self, x):
            self.parent.setdefault(x, x)

        def find(self, x):
            while self.parent[x] != x:
                self.parent[x] = self.parent[self.parent[x]]
                x = self.parent[x]
            return x

        def union(self, a, b):
            self.parent[self.find(a)] = self.find(b)

    def count_islands(grid):
        ds = DisjointSet()
        for r, row in enumerate(grid):
            for c, ch in enumerate(row):
                if ch != '1':
                    continue
                ds.add((r, c))
                if r and grid[r - 1][c] == '1':
                    ds.union((r, c), (r - 1, c))
                if c and row[c - 1] == '1':
                    ds.union((r, c), (r, c - 1))
        return len({ds.find(x) for x in ds.parent})
    """,
      fenced_stack=_fenced("""
    def count_islands(grid: list[str]) -> int:
        rows = len(grid)
        cols = len(grid[0]) if rows else 0
        visited = [[False] * cols for _ in range(rows)]
        count = 0
        for i in range(rows):
            for j in range(cols):
                if grid[i][j] == '1' and not visited[i][j]:
                    count += 1
                    stack = [(i, j)]
                    visited[i][j] = True
                    while stack:
                        r, c = stack.pop()
                        for nr, nc in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
                            if 0 <= nr < rows and 0 <= nc < cols and grid[nr][nc] == '1' and not visited[nr][nc]:
                                visited[nr][nc] = True
                                stack.append((nr, nc))
        return count
    """))

# ------------------------------------------------------------------ dates
_task("day_of_week", """
    assert candidate('2024-03-05') == 'Tuesday'
    assert candidate('2000-01-01') == 'Saturday'
    assert candidate('1970-01-01') == 'Thursday'
    assert candidate('2023-12-31') == 'Sunday'
    """,
      strftime="""
    from datetime import date

    def day_of_week(s):
        return date.fromisoformat(s).strftime('%A')
    """,
      calendar_day_name="""
    import calendar
    import datetime

    def day_of_week(s):
        return calendar.day_name[datetime.date.fromisoformat(s).weekday()]
    """,
      zeller="""
    NAMES = ('Saturday', 'Sunday', 'Monday', 'Tuesday', 'Wednesday', 'Thursday', 'Friday')

    def day_of_week(s):
        '''Zeller's congruence, no datetime needed.'''
        y, m, d = map(int, s.split('-'))
        if m < 3:
            m += 12
            y -= 1
        k, j = y % 100, y // 100
        h = (d + 13 * (m + 1) // 5 + k + k // 4 + j // 4 + 5 * j) % 7
        return NAMES[h]
    """,
      fenced_enum_strptime=_fenced("""
    from datetime import datetime
    from enum import Enum

    class Weekday(Enum):
        MONDAY = 1
        TUESDAY = 2
        WEDNESDAY = 3
        THURSDAY = 4
        FRIDAY = 5
        SATURDAY = 6
        SUNDAY = 7

    def day_of_week(s: str) -> str:
        day = Weekday(datetime.strptime(s, '%Y-%m-%d').isoweekday())
        return day.name.capitalize()
    """))

_task("days_between", """
    assert candidate('2024-01-01', '2024-03-01') == 60
    assert candidate('2023-12-25', '2023-12-25') == 0
    assert candidate('2024-03-01', '2023-03-01') == 366
    """,
      fromisoformat="""
    from datetime import date

    def days_between(a, b):
        return abs((date.fromisoformat(b) - date.fromisoformat(a)).days)
    """,
      strptime="""
    from datetime import datetime

    FORMAT = '%Y-%m-%d'

    def days_between(a, b):
        delta = datetime.strptime(a, FORMAT) - datetime.strptime(b, FORMAT)
        return abs(delta.days)
    """,
      toordinal="""
    import datetime

    def days_between(a: str, b: str) -> int:
        ordinal = lambda s: datetime.date(*map(int, s.split('-'))).toordinal()
        return abs(ordinal(a) - ordinal(b))
    """,
      fenced_civil_arithmetic=_fenced("""
    def _days_from_civil(y: int, m: int, d: int) -> int:
        '''Days since 1970-01-01 (proleptic Gregorian), no datetime needed.'''
        y -= m <= 2
        era = (y if y >= 0 else y - 399) // 400
        yoe = y - era * 400
        doy = (153 * (m + (-3 if m > 2 else 9)) + 2) // 5 + d - 1
        doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
        return era * 146097 + doe - 719468

    def days_between(a: str, b: str) -> int:
        da = _days_from_civil(*map(int, a.split('-')))
        db = _days_from_civil(*map(int, b.split('-')))
        return abs(da - db)
    """))

# ------------------------------------------------------------------ mutation and callables
_task("rotate_in_place", """
    xs = [1, 2, 3, 4, 5]
    assert candidate(xs, 2) is None
    assert xs == [4, 5, 1, 2, 3]
    ys = [1, 2, 3]
    candidate(ys, -1)
    assert ys == [2, 3, 1]
    zs = []
    candidate(zs, 3)
    assert zs == []
    """,
      slice_assignment="""
    def rotate_in_place(xs, k):
        if xs:
            k %= len(xs)
            xs[:] = xs[-k:] + xs[:-k]
    """,
      three_reversals="""
    def rotate_in_place(xs, k):
        n = len(xs)
        if n == 0:
            return
        k %= n

        def rev(i, j):
            while i < j:
                xs[i], xs[j] = xs[j], xs[i]
                i += 1
                j -= 1

        rev(0, n - 1)
        rev(0, k - 1)
        rev(k, n - 1)
    """,
      pop_insert="""
    def rotate_in_place(xs, k):
        if not xs:
            return None
        for _ in range(k % len(xs)):
            xs.insert(0, xs.pop())
    """,
      deque_rotate="""
    from collections import deque

    def rotate_in_place(xs: list, k: int) -> None:
        d = deque(xs)
        d.rotate(k)
        xs[:] = d
    """)

_task("remove_all", """
    xs = [1, 2, 1, 3, 1]
    assert candidate(xs, 1) == 3
    assert xs == [2, 3]
    ys = ['a']
    assert candidate(ys, 'b') == 0 and ys == ['a']
    """,
      while_remove="""
    def remove_all(xs, value):
        removed = 0
        while value in xs:
            xs.remove(value)
            removed += 1
        return removed
    """,
      slice_comprehension="""
    def remove_all(xs, value):
        before = len(xs)
        xs[:] = [x for x in xs if x != value]
        return before - len(xs)
    """,
      reverse_del="""
    def remove_all(xs, value):
        count = 0
        for i in range(len(xs) - 1, -1, -1):
            if xs[i] == value:
                del xs[i]
                count += 1
        return count
    """,
      fenced_write_index=_fenced("""
    def remove_all(xs, value):
        write = 0
        for x in xs:
            if x != value:
                xs[write] = x
                write += 1
        removed = len(xs) - write
        del xs[write:]
        return removed
    """))

_task("tally", """
    d = {'a': 1}
    assert candidate(d, ['a', 'b', 'a']) is None
    assert d == {'a': 3, 'b': 1}
    e = {}
    candidate(e, [])
    assert e == {}
    """,
      dict_get="""
    def tally(counts, words):
        for w in words:
            counts[w] = counts.get(w, 0) + 1
    """,
      setdefault="""
    def tally(counts, words):
        for w in words:
            counts.setdefault(w, 0)
            counts[w] += 1
        return None
    """,
      counter_items="""
    from collections import Counter

    def tally(counts, words):
        for w, n in Counter(words).items():
            counts[w] = counts.get(w, 0) + n
    """,
      try_except="""
    def tally(counts: dict, words: list) -> None:
        '''Add one to counts[w] for every w in words, in place.'''
        for w in words:
            try:
                counts[w] += 1
            except KeyError:
                counts[w] = 1
    """)

_task("apply_n", """
    assert candidate(lambda v: v * 2, 3, 1) == 8
    assert candidate(str.upper, 1, 'ab') == 'AB'
    assert candidate(lambda v: v + 1, 0, 5) == 5
    assert candidate(lambda v: v + [len(v)], 3, []) == [0, 1, 2]
    """,
      loop="""
    def apply_n(f, n, x):
        for _ in range(n):
            x = f(x)
        return x
    """,
      recursive="""
    def apply_n(f, n, x):
        return x if n == 0 else apply_n(f, n - 1, f(x))
    """,
      reduce="""
    from functools import reduce

    def apply_n(f, n, x):
        return reduce(lambda acc, _: f(acc), range(n), x)
    """,
      fenced_compose=_fenced("""
    from typing import Callable, TypeVar

    T = TypeVar('T')

    def apply_n(f: Callable[[T], T], n: int, x: T) -> T:
        def compose(g, h):
            return lambda v: h(g(v))
        fn = lambda v: v
        for _ in range(n):
            fn = compose(fn, f)
        return fn(x)
    """))

_task("top_k_by", """
    assert candidate(['bb', 'a', 'ccc', 'dd'], 2, len) == ['ccc', 'bb']
    assert candidate([3, 1, 2], 5, lambda x: -x) == [1, 2, 3]
    assert candidate([], 1, abs) == []
    assert candidate([-5, 2, 4], 1, key=abs) == [-5]
    """,
      sorted_reverse="""
    def top_k_by(items, k, key):
        return sorted(items, key=key, reverse=True)[:k]
    """,
      heapq_nlargest="""
    import heapq

    def top_k_by(items, k, key):
        return heapq.nlargest(k, items, key=key)
    """,
      decorate_sort="""
    def top_k_by(items, k, key):
        decorated = [(key(item), -i, item) for i, item in enumerate(items)]
        decorated.sort(reverse=True)
        return [item for _, _, item in decorated[:k]]
    """,
      cmp_to_key="""
    from functools import cmp_to_key

    def top_k_by(items, k, key):
        keyed = list(enumerate(items))

        def cmp(a, b):
            ka, kb = key(a[1]), key(b[1])
            if ka != kb:
                return -1 if ka > kb else 1
            return a[0] - b[0]

        return [item for _, item in sorted(keyed, key=cmp_to_key(cmp))][:k]
    """)

_task("partition", """
    assert candidate([1, 2, 3, 4], lambda x: x % 2 == 0) == ([2, 4], [1, 3])
    assert candidate([], bool) == ([], [])
    assert candidate(['', 'a'], bool) == (['a'], [''])
    """,
      loop="""
    def partition(xs, pred):
        yes, no = [], []
        for x in xs:
            (yes if pred(x) else no).append(x)
        return yes, no
    """,
      two_comprehensions="""
    def partition(xs, pred):
        return [x for x in xs if pred(x)], [x for x in xs if not pred(x)]
    """,
      tee_filterfalse="""
    from itertools import filterfalse, tee

    def partition(xs, pred):
        a, b = tee(xs)
        return list(filter(pred, a)), list(filterfalse(pred, b))
    """,
      fenced_reduce=_fenced("""
    from functools import reduce

    def partition(xs, pred):
        return reduce(lambda acc, x: (acc[0] + [x], acc[1]) if pred(x) else (acc[0], acc[1] + [x]), xs, ([], []))
    """))

# ------------------------------------------------------------------ classes
_task("final_balance", """
    assert candidate([('deposit', 100), ('withdraw', 30)]) == 70
    assert candidate([]) == 0
    assert candidate([('deposit', 5), ('deposit', 5), ('withdraw', 10)]) == 0
    """ + _raises("[('withdraw', 1)]") + _raises("[('steal', 5)]"),
      if_chain="""
    def final_balance(transactions):
        balance = 0
        for kind, amount in transactions:
            if kind == 'deposit':
                balance += amount
            elif kind == 'withdraw':
                if amount > balance:
                    raise ValueError('insufficient funds')
                balance -= amount
            else:
                raise ValueError(f'unknown transaction {kind!r}')
        return balance
    """,
      account_class="""
    class InsufficientFunds(ValueError):
        pass

    class Account:
        def __init__(self):
            self.balance = 0

        def deposit(self, amount):
            self.balance += amount

        def withdraw(self, amount):
            if amount > self.balance:
                raise InsufficientFunds(f'balance {self.balance} < {amount}')
            self.balance -= amount

    def final_balance(transactions):
        acct = Account()
        for kind, amount in transactions:
            if kind not in ('deposit', 'withdraw'):
                raise ValueError(kind)
            getattr(acct, kind)(amount)
        return acct.balance
    """,
      match_statement="""
    def final_balance(transactions):
        balance = 0
        for tx in transactions:
            match tx:
                case ('deposit', amount):
                    balance += amount
                case ('withdraw', amount) if amount <= balance:
                    balance -= amount
                case ('withdraw', _):
                    raise ValueError('insufficient funds')
                case _:
                    raise ValueError(f'unknown transaction {tx!r}')
        return balance
    """,
      fenced_dispatch_reduce=_fenced("""
    from functools import reduce

    def _withdraw(balance, amount):
        if amount > balance:
            raise ValueError('overdraft')
        return balance - amount

    OPERATIONS = {'deposit': lambda balance, amount: balance + amount, 'withdraw': _withdraw}

    def final_balance(transactions):
        def step(balance, tx):
            kind, amount = tx
            if kind not in OPERATIONS:
                raise ValueError(f'unknown kind {kind}')
            return OPERATIONS[kind](balance, amount)
        return reduce(step, transactions, 0)
    """))

_task("total_area", """
    assert candidate([('rect', 2, 3)]) == 6.0
    assert candidate([('square', 2), ('rect', 1, 5)]) == 9.0
    assert candidate([('circle', 1)]) == 3.14
    assert candidate([('circle', 2), ('square', 1)]) == 13.57
    assert candidate([]) == 0.0
    """,
      if_chain="""
    import math

    def total_area(shapes):
        total = 0.0
        for shape in shapes:
            kind = shape[0]
            if kind == 'circle':
                total += math.pi * shape[1] ** 2
            elif kind == 'rect':
                total += shape[1] * shape[2]
            elif kind == 'square':
                total += shape[1] ** 2
        return round(total, 2)
    """,
      abc_hierarchy="""
    import math
    from abc import ABC, abstractmethod

    class Shape(ABC):
        @abstractmethod
        def area(self):
            ...

    class Circle(Shape):
        def __init__(self, r):
            self.r = r

        def area(self):
            return math.pi * self.r ** 2

    class Rect(Shape):
        def __init__(self, w, h):
            self.w, self.h = w, h

        def area(self):
            return self.w * self.h

    class Square(Rect):
        def __init__(self, s):
            super().__init__(s, s)

    FACTORY = {'circle': Circle, 'rect': Rect, 'square': Square}

    def total_area(shapes):
        return round(sum(FACTORY[kind](*dims).area() for kind, *dims in shapes), 2)
    """,
      lambda_dispatch="""
    from math import pi

    AREA = {
        'circle': lambda r: pi * r * r,
        'rect': lambda w, h: w * h,
        'square': lambda s: s * s,
    }

    def total_area(shapes):
        return round(sum(AREA[s[0]](*s[1:]) for s in shapes), 2)
    """,
      fenced_dataclass_match=_fenced("""
    from __future__ import annotations

    import math
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Circle:
        r: float

    @dataclass(frozen=True)
    class Rect:
        w: float
        h: float

    def _parse(spec: tuple) -> Circle | Rect:
        match spec:
            case ('circle', r):
                return Circle(r)
            case ('rect', w, h):
                return Rect(w, h)
            case ('square', s):
                return Rect(s, s)
        raise ValueError(f'unknown shape {spec!r}')

    def _area(shape: Circle | Rect) -> float:
        match shape:
            case Circle(r=r):
                return math.pi * r * r
            case Rect(w=w, h=h):
                return w * h
        raise TypeError(shape)

    def total_area(shapes: list[tuple]) -> float:
        return round(sum(map(_area, map(_parse, shapes))), 2)
    """))


# ------------------------------------------------------------------ the tests
_FENCE = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


def _plain_program(name: str) -> str:
    """The case as one plain program: the code (out of its fence, if any), then the test."""
    completion, entry, test = CASES[name]
    m = _FENCE.search(completion)
    code = m.group(1) if m else completion
    return f"{code}\ncandidate = {entry}\n{test}"


_RUNNER = """
import json, sys, time, traceback
out = {}
for name, src in json.load(sys.stdin).items():
    t0 = time.process_time()
    try:
        exec(compile(src, name, 'exec', dont_inherit=True), {'__name__': '__main__'})
        err = None
    except BaseException as e:
        err = ''.join(traceback.format_exception_only(type(e), e)).strip()[-300:]
    out[name] = [err, time.process_time() - t0]  # CPU seconds: a busy machine does not inflate them
print('\\nRESULTS ' + json.dumps(out))
"""


@pytest.fixture(scope="module", params=MODES)
def scores(request: pytest.FixtureRequest) -> tuple[str, dict[str, Score]]:
    """The whole corpus scored in one batch through the pool of this mode."""
    names = sorted(CASES)
    answers = [codesets.tests_answer(CASES[n][1], [CASES[n][2]], setup="", prefix="") for n in names]
    with SandboxPool(2, isolation=request.param, cache_size=0) as pool:
        got = score_completions([CASES[n][0] for n in names], answers, pool=pool)
    return request.param, dict(zip(names, got))


@pytest.fixture(scope="module")
def plain_results() -> dict[str, list]:
    """Every case as a plain program in one fresh interpreter, each in fresh globals."""
    src = json.dumps({n: _plain_program(n) for n in CASES})
    res = subprocess.run([sys.executable, "-I", "-c", _RUNNER], input=src, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.rsplit("\nRESULTS ", 1)[1])


@pytest.mark.parametrize("name", sorted(CASES))
def test_corpus_scores_one(scores: tuple[str, dict[str, Score]], name: str, request: pytest.FixtureRequest) -> None:
    mode, by_name = scores
    if (mode, name) in KNOWN_GAPS:
        request.applymarker(pytest.mark.xfail(strict=True, reason=KNOWN_GAPS[mode, name]))
    got = by_name[name]
    assert got is not None and got.score == 1.0, (mode, name, got)


@pytest.mark.parametrize("name", sorted(CASES))
def test_corpus_case_is_correct_python(plain_results: dict[str, list], name: str) -> None:
    """The corpus itself is right (and fast): completion + test as one plain program."""
    err, seconds = plain_results[name]
    assert err is None, (name, err)
    assert seconds < 0.5, (name, seconds)


def test_corpus_is_large_and_varied() -> None:
    entries = {entry for _, entry, _ in CASES.values()}
    assert len(CASES) >= 200
    assert len(entries) >= 40
    per_task = {e: sum(1 for _, entry, _ in CASES.values() if entry == e) for e in entries}
    assert min(per_task.values()) >= 4, per_task
    fenced = [n for n, (c, _, _) in CASES.items() if "```python" in c]
    assert len(fenced) >= 20, fenced
    assert sum("from __future__ import annotations" in c for c, _, _ in CASES.values()) >= 5
    assert all(test.count("assert") >= 2 for _, _, test in CASES.values())
