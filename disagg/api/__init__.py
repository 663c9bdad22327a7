"""The HTTP front door: OpenAI, SGLang-native, tokens-in/out and admin routes over aiohttp.

Build the app with `disagg.api.app.create_app(config, engine)`. Nothing here imports torch.
"""
