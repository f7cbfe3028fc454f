# Runs offline with `terraform test`: the module uses only built-in resources, so no provider is mocked.

variables {
  ansible_user = "sarv"
  gpu_groups = {
    h100 = {
      gpu_model        = "H100-SXM5-80GB"
      gpu_count        = 8
      gpu_memory_mib   = 81559
      gpu_interconnect = "nvlink"
      labels           = { tier = "prod" }
    }
  }
  hosts = [
    { name = "gpu-1", address = "10.0.0.11", gpu_group = "h100", roles = ["controlplane"] },
    { name = "svc-1", address = "10.0.0.21", roles = ["redis", "monitoring"], ssh_port = 2222 },
  ]
}

run "renders_groups_and_gpu_vars" {
  command = plan

  assert {
    condition     = output.inventory_data.groups["h100"][0] == "gpu-1"
    error_message = "gpu-1 must be in its GPU group"
  }
  assert {
    condition     = jsonencode(output.inventory_data.gpu_nodes.children) == jsonencode(["h100"])
    error_message = "gpu_nodes must have one child group per GPU type"
  }
  assert {
    condition     = jsonencode(output.inventory_data.groups["controlplane"]) == jsonencode(["gpu-1"]) && jsonencode(output.inventory_data.groups["monitoring"]) == jsonencode(["svc-1"])
    error_message = "roles must place hosts in the service groups"
  }
}

run "apply_records_inventory" {
  command = apply

  assert {
    condition     = strcontains(output.inventory, "[h100:vars]\nsarv_gpu_model=H100-SXM5-80GB\nsarv_gpu_count=8\nsarv_gpu_memory_mib=81559\nsarv_gpu_interconnect=nvlink\nsarv_labels=tier=prod\n")
    error_message = "GPU group variables missing or malformed"
  }
  assert {
    condition     = strcontains(output.inventory, "[redis]\nsvc-1 ansible_host=10.0.0.21 ansible_port=2222\n") && strcontains(output.inventory, "[monitoring]\nsvc-1\n")
    error_message = "connection variables must appear once, on the host's first group"
  }
}

run "rejects_unknown_gpu_group" {
  command = plan
  variables {
    hosts = [{ name = "gpu-9", address = "10.0.0.99", gpu_group = "nope" }]
  }
  expect_failures = [var.hosts]
}

run "rejects_nvidia_prefix_and_bad_interconnect" {
  command = plan
  variables {
    gpu_groups = {
      h100 = { gpu_model = "NVIDIA H100", gpu_count = 8, gpu_memory_mib = 81559, gpu_interconnect = "infiniband" }
    }
  }
  expect_failures = [var.gpu_groups]
}

run "rejects_two_monitoring_hosts" {
  command = plan
  variables {
    hosts = [
      { name = "svc-1", address = "10.0.0.21", roles = ["monitoring"] },
      { name = "svc-2", address = "10.0.0.22", roles = ["monitoring"] },
    ]
    gpu_groups = {}
  }
  expect_failures = [terraform_data.this]
}
