"""Sentence splitting for ``--split-sentences``: NLTK's Punkt models, as Megatron-LM uses them.

Megatron-LM splits each text with the Punkt model of ``--lang`` (in chunks of
one million characters) and, with ``--keep-newlines``, with a Punkt variant
whose sentences keep the whitespace that follows them. The Punkt parameters are
NLTK data (``tokenizers/punkt_tab/<lang>/``, found through ``NLTK_DATA`` or
NLTK's default folders). Nothing is downloaded: missing NLTK or missing data is
an immediate error naming what to install (Megatron-LM tries to download and
hangs without a network).
"""

# Megatron-LM hands Punkt at most this many characters at once.
SPLIT_CHUNK_CHARS = 1_000_000


class SentenceSplitterError(ValueError):
    """NLTK or its Punkt data is missing."""


def _keep_whitespace_language_vars():
    """Punkt language variables whose sentence boundaries keep trailing whitespace.

    Punkt normally consumes the whitespace between a sentence end and the next
    token; matching that whitespace inside the boundary context (and the next
    token right after it) leaves newlines attached to the sentence they follow,
    so the sentences concatenate back to the original text.
    """
    from nltk.tokenize.punkt import PunktLanguageVars

    class KeepWhitespaceLanguageVars(PunktLanguageVars):
        _period_context_fmt = r"""
            \S*                          # the word the candidate boundary ends
            %(SentEndChars)s             # a sentence-ending character
            \s*                          # whitespace after it stays in this sentence
            (?=(?P<after_tok>
                %(NonWord)s              # followed by punctuation
                |
                (?P<next_tok>\S+)        # or by the next token
            ))"""

    return KeepWhitespaceLanguageVars()


def build_sentence_splitter(lang: str = "english", keep_newlines: bool = False):
    """Returns a Punkt splitter with ``tokenize(text) -> list[str]``; raises
    SentenceSplitterError."""
    try:
        import nltk  # noqa: F401
        from nltk.tokenize.punkt import PunktSentenceTokenizer
    except ImportError as error:
        raise SentenceSplitterError(
            "--split-sentences needs the nltk package (pip install nltk) and its Punkt data"
        ) from error
    params = _load_punkt_params(lang)
    if keep_newlines:
        splitter = PunktSentenceTokenizer(lang_vars=_keep_whitespace_language_vars())
    else:
        splitter = PunktSentenceTokenizer()
    splitter._params = params
    return splitter


def _load_punkt_params(lang: str):
    import nltk.data

    resource = f"tokenizers/punkt_tab/{lang}/"
    try:
        from nltk.tokenize.punkt import load_punkt_params
    except ImportError as error:  # NLTK before 3.8.2 had only pickled models
        raise SentenceSplitterError(
            "--split-sentences needs nltk >= 3.8.2 (Punkt models as punkt_tab data)"
        ) from error
    try:
        lang_dir = nltk.data.find(resource)
    except LookupError as error:
        raise SentenceSplitterError(
            f"--split-sentences --lang {lang}: NLTK data {resource} not found in {nltk.data.path} "
            f"(install it with: python -m nltk.downloader -d DIR punkt_tab; then set NLTK_DATA=DIR)"
        ) from error
    except ValueError as error:
        raise SentenceSplitterError(f"--lang {lang}: not a Punkt model name ({error})") from error
    try:
        return load_punkt_params(lang_dir)
    except OSError as error:
        raise SentenceSplitterError(
            f"--lang {lang}: NLTK data {lang_dir} is incomplete ({error})"
        ) from error


def split_sentences(splitter, text: str) -> list:
    """Megatron-LM's splitting: Punkt on consecutive chunks of at most a million characters."""
    sentences = []
    for start in range(0, len(text), SPLIT_CHUNK_CHARS):
        sentences.extend(splitter.tokenize(text[start : start + SPLIT_CHUNK_CHARS]))
    return sentences
