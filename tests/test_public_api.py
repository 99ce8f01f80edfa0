"""The names README.md promises at the top level of the package."""

import normswap


def test_every_public_name_resolves():
    for name in normswap.__all__:
        assert getattr(normswap, name) is not None, name
    assert callable(normswap.perplexity) and callable(normswap.convert_model)


def test_unknown_names_still_raise_attribute_error():
    import pytest

    with pytest.raises(AttributeError):
        normswap.no_such_thing  # noqa: B018


def test_the_errors_the_api_raises_are_public():
    """patch/patch_checkpoint raise VerificationError and convert_checkpoint ConversionRefused,
    each carrying its report: a caller catches them without reaching into a submodule."""
    from normswap.api import ConversionRefused
    from normswap.swap import VerificationError

    assert normswap.VerificationError is VerificationError and normswap.ConversionRefused is ConversionRefused
    assert issubclass(VerificationError, normswap.NormswapError) and issubclass(ConversionRefused, normswap.NormswapError)
