"""GET /demo in a real headless browser (Debian's chromium, driven by selenium): a person draws a
stroke, or uploads a PNG, names a class and asks; the page shows the answer the API gives for
that very image (checked by sending the page's own canvas, or the file, to the API from here)."""
from __future__ import annotations

import base64
import io
import shutil

import httpx
import numpy as np
import pytest
from PIL import Image

pytestmark = pytest.mark.integration

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
IMAGE = {"height": 8, "width": 8, "channels": 1, "layout": "flat", "scale": 16.0 / 255.0, "background": "dark",
         "resample": "lanczos"}


def _missing() -> str | None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install '.[dev]')"
    if not CHROMIUM or not CHROMEDRIVER:
        return "chromium and its driver are not installed (apt-get install chromium chromium-driver)"
    return None


@pytest.fixture(scope="module")
def demo_url(tmp_path_factory):
    if (why := _missing()) is not None:
        pytest.skip(why)
    from serving.http.app import create_app
    from serving.bundle.synthetic import build_synthetic_bundle
    from tests.serving.helpers import make_settings, uvicorn_in_thread

    tmp = tmp_path_factory.mktemp("demo")
    bundle = build_synthetic_bundle(classes=20, dim=8, input_dim=64, seed=2, out=tmp / "bundle", image=IMAGE)
    with uvicorn_in_thread(create_app(make_settings(bundle, tmp))) as url:
        yield url


@pytest.fixture(scope="module")
def browser(demo_url):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1200,900"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def _open(browser, demo_url):
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(f"{demo_url}/demo")
    WebDriverWait(browser, 30).until(lambda d: "classes" in d.find_element("id", "model").text)


def _ask(browser, cls: str) -> dict:
    """Type the class, press Ask, and read the detect table once filled: {row name: value}."""
    from selenium.webdriver.support.ui import WebDriverWait

    field = browser.find_element("id", "cls")
    field.clear()
    field.send_keys(cls)
    browser.find_element("id", "ask").click()
    WebDriverWait(browser, 30).until(
        lambda d: d.find_elements("css selector", "#detect tr") or d.find_element("id", "error").text)
    assert browser.find_element("id", "error").text == ""
    rows = browser.find_elements("css selector", "#detect tr")
    return {r.find_elements("tag name", "td")[0].text: r.find_elements("tag name", "td")[1].text for r in rows}


def _api_detect(demo_url, png: bytes, cls: str) -> dict:
    r = httpx.post(f"{demo_url}/v1/classes/{cls}/detect", content=png, headers={"content-type": "image/png"})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_drawing_is_answered_as_the_api_answers_that_drawing(browser, demo_url):
    from selenium.webdriver.common.action_chains import ActionChains

    _open(browser, demo_url)
    pad = browser.find_element("id", "pad")
    ActionChains(browser).move_to_element_with_offset(pad, -40, -60).click_and_hold() \
        .move_by_offset(30, 50).move_by_offset(30, 60).release().perform()
    shown = _ask(browser, "3")
    canvas = browser.execute_script("return document.getElementById('pad').toDataURL('image/png')")
    png = base64.b64decode(canvas.split(",", 1)[1])
    assert np.asarray(Image.open(io.BytesIO(png)).convert("L")).max() == 255  # the stroke is on the canvas
    truth = _api_detect(demo_url, png, "3")
    assert shown["logit"] == f"{truth['results'][0]['logit']:.3f}"
    assert shown["threshold"] == f"{truth['threshold']:.3f}"
    assert shown["match"] == ("yes" if truth["results"][0]["match"] else "no")
    top = browser.find_elements("css selector", "#topk tbody tr")
    assert len(top) == 5 + 1  # five classes and the latency line
    assert shown["latency"].endswith(" ms")


def test_an_uploaded_image_is_sent_as_it_is(browser, demo_url, tmp_path):
    from selenium.webdriver.support.ui import WebDriverWait

    _open(browser, demo_url)
    digit = np.zeros((8, 8), np.uint8)
    digit[1:7, 3:5] = 255
    path = tmp_path / "digit.png"
    Image.fromarray(digit).save(path)
    browser.find_element("id", "file").send_keys(str(path))
    WebDriverWait(browser, 10).until(lambda d: d.execute_script("return upload !== null"))
    shown = _ask(browser, "7")
    truth = _api_detect(demo_url, path.read_bytes(), "7")
    assert shown["logit"] == f"{truth['results'][0]['logit']:.3f}"
    assert shown["class"] == "7 (id 7)"


def test_an_unknown_class_is_shown_as_the_api_error(browser, demo_url):
    from selenium.webdriver.support.ui import WebDriverWait

    _open(browser, demo_url)
    field = browser.find_element("id", "cls")
    field.clear()
    field.send_keys("no-such-class")
    browser.find_element("id", "ask").click()
    WebDriverWait(browser, 30).until(lambda d: d.find_element("id", "error").text)
    assert browser.find_element("id", "error").text.startswith("404 unknown_class")
