"""The privacy audit of a plan: what leaves each site, under which guarantee, who sees it, and the
code, certificates and transport it runs on (:mod:`.report`), as text for the privacy officer
(:mod:`.format`). It reads a plan and, where it runs, the site's workspace; a site's policy is checked
against it (:func:`fedcontrast.privacy.policy.check_policy`) before any data is read."""
