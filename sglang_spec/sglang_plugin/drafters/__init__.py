"""The drafters a tree server runs inside SGLang's draft step: one interface (``base.ServedDrafter``), one drafter
chosen at start-up per server (``choose.drafter_for``). Nothing is imported here, so that ``options`` can use
``beam_selection`` without loading the drafters."""
