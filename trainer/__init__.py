from common.moved import install

install({"trainer.lm_harness": "trainer.export.lm_harness"})
