"""The released-encoder repo: writing and reading its files, the card, verification, signing, heads,
import, push."""
