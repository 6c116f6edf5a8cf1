"""--split-sentences: NLTK's Punkt sentence splitter, as Megatron-LM's preprocess_data.py uses it.

Needs the optional extra ``mindtrain-data[sentences]`` (nltk) and NLTK's ``punkt_tab`` data for
the language (``python -m nltk.downloader punkt_tab``; NLTK_DATA names another data folder).
punkt_tab holds the same Punkt parameters as the pickled ``punkt`` models Megatron loads, as
plain text, so loading it runs no code.
"""

from __future__ import annotations

from mindtrain.data.errors import UserError

# Megatron splits very long texts in pieces of this many characters before Punkt sees them.
PIECE = 1000000


def _keep_newlines_vars():
    from nltk.tokenize.punkt import PunktLanguageVars

    class KeepNewlines(PunktLanguageVars):
        """Punkt's period context with the whitespace after a sentence end kept in the sentence.

        Megatron's --keep-newlines uses this pattern so that the newlines between sentences
        survive the split: ``\\s*`` after the end characters and ``\\S+`` for the next token.
        """

        _period_context_fmt = r"""
        \S*                          # some word material
        %(SentEndChars)s             # a potential sentence ending
        \s*                          # whitespace after the end stays with this sentence
        (?=(?P<after_tok>
            %(NonWord)s              # either other punctuation
            |
            (?P<next_tok>\S+)        # or the next word, without leading whitespace
        ))"""

    return KeepNewlines()


def load_splitter(lang: str = "english", keep_newlines: bool = False):
    """A Punkt tokenizer for ``lang``; a one-line UserError when nltk or its data is missing."""
    try:
        from nltk.tokenize.punkt import PunktSentenceTokenizer, PunktTokenizer
    except ImportError:
        raise UserError("--split-sentences: needs nltk >= 3.9: pip install 'mindtrain-data[sentences]'") from None
    try:
        punkt = PunktTokenizer(lang)
    except ValueError as err:
        raise UserError(f"--lang: {lang!r} is not a punkt model name ({err})") from None
    except LookupError:
        raise UserError(f"--split-sentences: NLTK's punkt_tab data for --lang {lang} is not installed; run "
                        "python -m nltk.downloader punkt_tab (or point NLTK_DATA at a folder holding it)") from None
    if keep_newlines:
        return PunktSentenceTokenizer(train_text=punkt._params, lang_vars=_keep_newlines_vars())
    return punkt


def split_sentences(splitter, text: str) -> list:
    """The sentences of ``text``, as Megatron's split step produces them."""
    return [s for i in range(0, len(text), PIECE) for s in splitter.tokenize(text[i:i + PIECE])]
